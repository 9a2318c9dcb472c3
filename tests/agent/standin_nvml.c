/*
 * A stand-in for NVIDIA's libnvidia-ml.so.1, so that the agent's GPU source runs through the real pynvml bindings
 * on machines without a GPU (CI). It implements only the C functions pynvml calls for the agent, with the same
 * signatures and struct layouts, and answers from a scenario file named by $CLUSTERDX_STANDIN_NVML:
 *
 *     gpus 8                                   # how many GPUs (default 8)
 *     <at_s> <gpu|*> <field> <value> [<per_s>] # from at_s on, field = value + per_s * (t - at_s)
 *     <at_s> <gpu|*> xid <code>                # one Xid event, delivered through nvmlEventSetWait
 *     <at_s> <gpu|*> error <function|*> <code> # from at_s on, that function returns that NVML error (0 = fixed)
 *
 * t is seconds since nvmlInit. The latest line that applies wins; fields without a line keep H100-like defaults.
 * Built by tests/agent/conftest.py with `cc -shared -fPIC`; -DSTANDIN_OLD_DRIVER leaves out functions that old
 * drivers lack, to exercise the agent's fall-backs.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define XID_EVENT 0x8ULL
#define MEMORY_V2 0x02000028u

#define MAX_GPUS 64
#define MAX_LINES 2048

typedef struct standin_gpu { int index; unsigned long long events; } *nvmlDevice_t;
typedef struct standin_set { int unused; } *nvmlEventSet_t;

enum { F_UTIL_GPU, F_UTIL_MEM, F_MEM_TOTAL, F_MEM_USED, F_TEMP, F_POWER_MW, F_POWER_LIMIT_MW, F_SM_CLOCK,
       F_SM_CLOCK_MAX, F_MEM_CLOCK, F_MEM_CLOCK_MAX, F_THROTTLE, F_ECC_SBE_VOL, F_ECC_DBE_VOL, F_ECC_SBE_AGG,
       F_ECC_DBE_AGG, F_RETIRED_SBE, F_RETIRED_DBE, F_RETIRED_PENDING, F_REMAP_CORR, F_REMAP_UNC, F_REMAP_PENDING,
       F_REMAP_FAILURE, F_PCIE_REPLAY, F_PCIE_GEN, F_PCIE_GEN_MAX, F_PCIE_WIDTH, F_PCIE_WIDTH_MAX, F_NVLINKS,
       F_NVLINKS_DOWN, F_NVLINK_REPLAY, F_NVLINK_RECOVERY, F_NVLINK_CRC_FLIT, F_NVLINK_CRC_DATA, F_COUNT };

static const char *FIELD_NAMES[F_COUNT] = {
    "util_gpu", "util_mem", "mem_total", "mem_used", "temp", "power_mw", "power_limit_mw", "sm_clock",
    "sm_clock_max", "mem_clock", "mem_clock_max", "throttle", "ecc_sbe_volatile", "ecc_dbe_volatile",
    "ecc_sbe_aggregate", "ecc_dbe_aggregate", "retired_sbe", "retired_dbe", "retired_pending", "remap_correctable",
    "remap_uncorrectable", "remap_pending", "remap_failure", "pcie_replay", "pcie_gen", "pcie_gen_max",
    "pcie_width", "pcie_width_max", "nvlinks", "nvlinks_down", "nvlink_replay", "nvlink_recovery",
    "nvlink_crc_flit", "nvlink_crc_data",
};

static const double DEFAULTS[F_COUNT] = {
    87, 41, 85899345920.0, 61203283968.0, 64, 612000, 700000, 1980,
    1980, 2619, 2619, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0,
    0, 0, 5, 5, 16, 16, 18,
    0, 0, 0, 0, 0,
};

enum { L_VALUE, L_XID, L_ERROR };

struct line {
    double at, value, rate;
    int gpu, kind, field, code;
    char func[64];
    unsigned char delivered[MAX_GPUS];
};

static struct standin_gpu gpus[MAX_GPUS];
static struct standin_set the_set;
static struct line lines[MAX_LINES];
static int n_lines, gpu_count = 8, initialized;
static struct timespec t0;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0.tv_sec) + (double)(t.tv_nsec - t0.tv_nsec) / 1e9;
}

static int field_index(const char *name) {
    for (int i = 0; i < F_COUNT; i++)
        if (strcmp(FIELD_NAMES[i], name) == 0) return i;
    return -1;
}

static void parse_line(char *buf) {
    char *hash = strchr(buf, '#');
    if (hash) *hash = 0;
    char who[16], what[64], arg[64], extra[32];
    double at;
    struct line *l = &lines[n_lines];
    memset(l, 0, sizeof *l);
    if (sscanf(buf, "gpus %d", &gpu_count) == 1) {
        if (gpu_count > MAX_GPUS) gpu_count = MAX_GPUS;
        return;
    }
    int n = sscanf(buf, "%lf %15s %63s %63s %31s", &at, who, what, arg, extra);
    if (n < 4 || n_lines >= MAX_LINES) return;
    l->at = at;
    l->gpu = strcmp(who, "*") == 0 ? -1 : atoi(who);
    if (strcmp(what, "xid") == 0) {
        l->kind = L_XID;
        l->code = atoi(arg);
    } else if (strcmp(what, "error") == 0) {
        if (n < 5) return;
        l->kind = L_ERROR;
        snprintf(l->func, sizeof l->func, "%s", arg);
        l->code = atoi(extra);
    } else {
        l->kind = L_VALUE;
        l->field = field_index(what);
        if (l->field < 0) {
            fprintf(stderr, "standin-nvml: unknown field %s\n", what);
            return;
        }
        l->value = strtod(arg, NULL);
        l->rate = n >= 5 ? strtod(extra, NULL) : 0;
    }
    n_lines++;
}

static void load_scenario(void) {
    const char *path = getenv("CLUSTERDX_STANDIN_NVML");
    FILE *f = path ? fopen(path, "r") : NULL;
    char buf[512];
    n_lines = 0;
    if (!f) return;
    while (fgets(buf, sizeof buf, f)) parse_line(buf);
    fclose(f);
}

static int applies(const struct line *l, int gpu, double t) { return l->at <= t && (l->gpu < 0 || l->gpu == gpu); }

static double value(nvmlDevice_t dev, int field) {
    double t = now_s(), v = DEFAULTS[field];
    for (int i = 0; i < n_lines; i++) {
        const struct line *l = &lines[i];
        if (l->kind == L_VALUE && l->field == field && applies(l, dev->index, t)) v = l->value + l->rate * (t - l->at);
    }
    return v;
}

/* The NVML error a device function returns for this GPU now (0 when it works). */
static int scripted_error(nvmlDevice_t dev, const char *func) {
    double t = now_s();
    int code = 0;
    for (int i = 0; i < n_lines; i++) {
        const struct line *l = &lines[i];
        if (l->kind == L_ERROR && applies(l, dev->index, t) && (strcmp(l->func, "*") == 0 || strcmp(l->func, func) == 0))
            code = l->code;
    }
    return code;
}

#define DEVICE_CALL(dev)                                          \
    do {                                                          \
        if (!initialized) return NVML_ERROR_UNINITIALIZED;        \
        if (!(dev)) return NVML_ERROR_INVALID_ARGUMENT;           \
        int scripted_ = scripted_error((dev), __func__);          \
        if (scripted_) return scripted_;                          \
    } while (0)

#define UINT(dev, f) ((unsigned int)value((dev), (f)))
#define ULL(dev, f) ((unsigned long long)value((dev), (f)))

/* ---- library --------------------------------------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (!initialized) {
        clock_gettime(CLOCK_MONOTONIC, &t0);
        load_scenario();
        for (int i = 0; i < MAX_GPUS; i++) gpus[i].index = i;
    }
    initialized++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    initialized--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    default: return "Stand-in error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    snprintf(version, length, "550.54.15-standin");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    *count = (unsigned int)gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (index >= (unsigned int)gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

/* ---- identity --------------------------------------------------------------------------------------------- */

static const unsigned int PCI_BUSES[8] = {0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb};

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length) {
    DEVICE_CALL(dev);
    snprintf(name, length, "NVIDIA H100 80GB HBM3");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int length) {
    DEVICE_CALL(dev);
    snprintf(uuid, length, "GPU-5ad1e000-0000-4000-8000-%012d", dev->index);
    return NVML_SUCCESS;
}

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci) {
    DEVICE_CALL(dev);
    memset(pci, 0, sizeof *pci);
    pci->bus = dev->index < 8 ? PCI_BUSES[dev->index] : (unsigned int)(0x10 + dev->index);
    pci->pciDeviceId = 0x233010de;
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}

/* ---- utilisation, memory, thermals, power, clocks -------------------------------------------------------- */

typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *util) {
    DEVICE_CALL(dev);
    util->gpu = UINT(dev, F_UTIL_GPU);
    util->memory = UINT(dev, F_UTIL_MEM);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    DEVICE_CALL(dev);
    mem->total = ULL(dev, F_MEM_TOTAL);
    mem->used = ULL(dev, F_MEM_USED);
    mem->free = mem->total - mem->used;
    return NVML_SUCCESS;
}

#ifndef STANDIN_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem) {
    DEVICE_CALL(dev);
    if (mem->version != MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem->total = ULL(dev, F_MEM_TOTAL);
    mem->reserved = 536870912ULL;
    mem->used = ULL(dev, F_MEM_USED);
    mem->free = mem->total - mem->reserved - mem->used;
    return NVML_SUCCESS;
}
#endif

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t dev, int sensor, unsigned int *temp) {
    DEVICE_CALL(dev);
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = UINT(dev, F_TEMP);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t dev, unsigned int *mw) {
    DEVICE_CALL(dev);
    *mw = UINT(dev, F_POWER_MW);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t dev, unsigned int *mw) {
    DEVICE_CALL(dev);
    *mw = UINT(dev, F_POWER_LIMIT_MW);
    return NVML_SUCCESS;
}

/* clock types: 0 graphics, 1 SM, 2 memory, 3 video */
static int clock_field(int type, int max) {
    if (type == 0 || type == 1) return max ? F_SM_CLOCK_MAX : F_SM_CLOCK;
    if (type == 2) return max ? F_MEM_CLOCK_MAX : F_MEM_CLOCK;
    return -1;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t dev, int type, unsigned int *mhz) {
    DEVICE_CALL(dev);
    int f = clock_field(type, 0);
    if (f < 0) return NVML_ERROR_NOT_SUPPORTED;
    *mhz = UINT(dev, f);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t dev, int type, unsigned int *mhz) {
    DEVICE_CALL(dev);
    int f = clock_field(type, 1);
    if (f < 0) return NVML_ERROR_NOT_SUPPORTED;
    *mhz = UINT(dev, f);
    return NVML_SUCCESS;
}

#ifndef STANDIN_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t dev, unsigned long long *reasons) {
    DEVICE_CALL(dev);
    *reasons = ULL(dev, F_THROTTLE);
    return NVML_SUCCESS;
}
#endif

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t dev, unsigned long long *reasons) {
    DEVICE_CALL(dev);
    *reasons = ULL(dev, F_THROTTLE);
    return NVML_SUCCESS;
}

/* ---- memory errors ---------------------------------------------------------------------------------------- */

/* errorType: 0 corrected, 1 uncorrected; counterType: 0 volatile, 1 aggregate */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t dev, int errorType, int counterType, unsigned long long *n) {
    DEVICE_CALL(dev);
    if (errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1) return NVML_ERROR_INVALID_ARGUMENT;
    static const int fields[2][2] = {{F_ECC_SBE_VOL, F_ECC_SBE_AGG}, {F_ECC_DBE_VOL, F_ECC_DBE_AGG}};
    *n = ULL(dev, fields[errorType][counterType]);
    return NVML_SUCCESS;
}

/* cause: 0 multiple single-bit errors, 1 double-bit error */
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t dev, int cause, unsigned int *count, unsigned long long *pages) {
    DEVICE_CALL(dev);
    if (cause < 0 || cause > 1) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int have = UINT(dev, cause ? F_RETIRED_DBE : F_RETIRED_SBE);
    if (!pages || *count < have) {
        *count = have;
        return have ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (unsigned int i = 0; i < have; i++) pages[i] = 0x1000ULL * (i + 1);
    *count = have;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t dev, int *pending) {
    DEVICE_CALL(dev);
    *pending = UINT(dev, F_RETIRED_PENDING) ? 1 : 0;
    return NVML_SUCCESS;
}

#ifndef STANDIN_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t dev, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failure) {
    DEVICE_CALL(dev);
    *corr = UINT(dev, F_REMAP_CORR);
    *unc = UINT(dev, F_REMAP_UNC);
    *pending = UINT(dev, F_REMAP_PENDING) ? 1 : 0;
    *failure = UINT(dev, F_REMAP_FAILURE) ? 1 : 0;
    return NVML_SUCCESS;
}
#endif

/* ---- PCIe and NVLink -------------------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t dev, unsigned int *n) {
    DEVICE_CALL(dev);
    *n = UINT(dev, F_PCIE_REPLAY);
    return NVML_SUCCESS;
}

#define PCIE_GETTER(fn, field)                                  \
    nvmlReturn_t fn(nvmlDevice_t dev, unsigned int *out) {      \
        DEVICE_CALL(dev);                                       \
        *out = UINT(dev, field);                                \
        return NVML_SUCCESS;                                    \
    }

PCIE_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, F_PCIE_GEN)
PCIE_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, F_PCIE_GEN_MAX)
PCIE_GETTER(nvmlDeviceGetCurrPcieLinkWidth, F_PCIE_WIDTH)
PCIE_GETTER(nvmlDeviceGetMaxPcieLinkWidth, F_PCIE_WIDTH_MAX)

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t dev, unsigned int link, int *active) {
    DEVICE_CALL(dev);
    unsigned int links = UINT(dev, F_NVLINKS);
    if (links == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= links) return NVML_ERROR_INVALID_ARGUMENT;
    *active = link >= UINT(dev, F_NVLINKS_DOWN) ? 1 : 0;  /* the first nvlinks_down links are down */
    return NVML_SUCCESS;
}

/* counter: 0 replay, 1 recovery, 2 CRC flit, 3 CRC data; the whole count sits on link 0 */
nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t dev, unsigned int link, int counter,
                                             unsigned long long *n) {
    DEVICE_CALL(dev);
    unsigned int links = UINT(dev, F_NVLINKS);
    if (links == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= links || counter < 0 || counter > 3) return NVML_ERROR_INVALID_ARGUMENT;
    *n = link == 0 ? ULL(dev, F_NVLINK_REPLAY + counter) : 0;
    return NVML_SUCCESS;
}

/* NVLink totals over all links as field values (one call per GPU; the per-link counters are the fall-back). */
typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned int valueType, nvmlReturn;
    union { double d; unsigned int ui; unsigned long ul; unsigned long long ull; long long sll; int si; } value;
} nvmlFieldValue_t;

static int nvlink_total_field(unsigned int id) {
    switch (id) {
    case 38: return F_NVLINK_CRC_FLIT;  /* NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL */
    case 45: return F_NVLINK_CRC_DATA;  /* NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL */
    case 52: return F_NVLINK_REPLAY;    /* NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL */
    case 59: return F_NVLINK_RECOVERY;  /* NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL */
    default: return -1;
    }
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t dev, int count, nvmlFieldValue_t *values) {
    DEVICE_CALL(dev);
    int has_links = UINT(dev, F_NVLINKS) > 0;
    for (int i = 0; i < count; i++) {
        int f = nvlink_total_field(values[i].fieldId);
        values[i].timestamp = (long long)(now_s() * 1e6);
        values[i].latencyUsec = 0;
        if (f < 0 || !has_links) {
            values[i].nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            continue;
        }
        values[i].nvmlReturn = NVML_SUCCESS;
        values[i].valueType = 3; /* unsigned long long */
        values[i].value.ull = ULL(dev, f);
    }
    return NVML_SUCCESS;
}

/* ---- events ----------------------------------------------------------------------------------------------- */

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    *set = &the_set;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    (void)set;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t dev, unsigned long long *types) {
    DEVICE_CALL(dev);
    *types = XID_EVENT | 0x1ULL | 0x4ULL;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t dev, unsigned long long types, nvmlEventSet_t set) {
    DEVICE_CALL(dev);
    if (set != &the_set) return NVML_ERROR_INVALID_ARGUMENT;
    dev->events |= types;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms) {
    (void)timeout_ms;  /* the agent polls with 0; a stand-in has nothing to wait for */
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (set != &the_set) return NVML_ERROR_INVALID_ARGUMENT;
    double t = now_s();
    for (int i = 0; i < n_lines; i++) {
        struct line *l = &lines[i];
        if (l->kind != L_XID || l->at > t) continue;
        for (int g = 0; g < gpu_count; g++) {
            if ((l->gpu >= 0 && l->gpu != g) || l->delivered[g] || !(gpus[g].events & XID_EVENT)) continue;
            l->delivered[g] = 1;
            memset(data, 0, sizeof *data);
            data->device = &gpus[g];
            data->eventType = XID_EVENT;
            data->eventData = (unsigned long long)l->code;
            data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_TIMEOUT;
}
