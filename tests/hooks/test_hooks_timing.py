"""StepTimer's arithmetic, the deferred (CUDA-event) path driven by a clock whose marks complete when the test
says so (this machine has no GPU), and the run metadata helpers."""

from __future__ import annotations

import pytest
import torch

from clusterdx import wire
from trainer_hooks import Monitor, StepTimer, meta
from trainer_hooks.monitor import batch_size
from trainer_hooks.timing import CudaClock, union_length
from trainer_hooks.transport import Config


class Mark:
    """Stands in for a CUDA event: a GPU timestamp that becomes readable only once ``done``."""

    def __init__(self, t: float) -> None:
        self.t, self.done = t, False


class LateClock:
    """Marks complete only when the test says so; counts synchronize calls (there must be none)."""

    deferred = True

    def __init__(self) -> None:
        self.now, self.marks, self.released = 0.0, [], 0

    def mark(self) -> Mark:
        self.marks.append(Mark(self.now))
        return self.marks[-1]

    def ready(self, mark: Mark) -> bool:
        return mark.done

    def seconds(self, start: Mark, end: Mark) -> float:
        assert start.done and end.done, "read before the GPU got there: that would have been a synchronize"
        return end.t - start.t

    def release(self, mark: Mark) -> None:
        self.released += 1

    def complete_all(self) -> None:
        for m in self.marks:
            m.done = True


def test_union_length_counts_overlap_once():
    assert union_length([]) == 0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3)
    assert union_length([(2, 3), (0, 10)]) == pytest.approx(10)


def test_a_cpu_step_adds_up_and_validates():
    records: list[dict] = []
    timer = StepTimer("r", 3, lambda step: records.append(step.as_record()))
    timer.add_fetch(10.0, 10.2)  # the loader's own clock reads
    timer.begin(step=7, tokens=4096, samples=8)
    token = timer.comm_begin()
    timer.comm_end(token)
    timer.end()
    assert records == []  # held for metrics logged after the step
    timer.log({"loss": 2.5, "lr": torch.tensor(1e-3)})
    timer.poll()
    (rec,) = records
    wire.validate(wire.Step, rec)
    assert (rec["rank"], rec["step"], rec["tokens"], rec["samples"]) == (3, 7, 4096, 8)
    assert rec["data_wait_s"] == pytest.approx(0.2)
    assert rec["step_time_s"] >= rec["data_wait_s"] + rec["compute_s"] + rec["comm_s"] - 1e-9
    assert rec["metrics"] == {"loss": 2.5, "lr": pytest.approx(1e-3)}
    assert timer.step == 8


def test_deferred_marks_are_read_only_once_done_and_late_steps_go_without_gpu_times():
    records: list[dict] = []
    clock = LateClock()
    timer = StepTimer("r", 0, lambda step: records.append(step.as_record()), clock=clock, max_pending=2)
    for _ in range(3):
        timer.begin()
        clock.now += 1.0
        token = timer.comm_begin()
        clock.now += 0.25
        timer.comm_end(token)
        timer.end()
    timer.begin()  # polls: nothing is done, three pending > max_pending=2: the oldest goes without GPU times
    assert [r["step"] for r in records] == [0] and "compute_s" not in records[0] and timer.late == 1
    timer.end()
    clock.complete_all()
    timer.poll()
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[1]["comm_s"] == pytest.approx(0.25) and records[1]["compute_s"] == pytest.approx(1.0)
    assert records[1]["comm_arrive_s"] >= 1.0
    assert all(wire.validate(wire.Step, r) for r in records)
    assert "comm_s" not in records[3]  # step 3 had no collective
    assert clock.released == len(clock.marks) == 3 * 4 + 2  # every event goes back to the pool, the late ones too


def test_the_cuda_clock_recycles_its_events():
    made: list[object] = []

    class Event:
        def __init__(self) -> None:
            self.recorded = 0
            made.append(self)

        def record(self) -> None:
            self.recorded += 1

    clock = CudaClock(Event)
    first = clock.mark()
    clock.release(first)
    assert clock.mark() is first and first.recorded == 2 and len(made) == 1


def test_a_step_that_raises_is_not_reported(hook_env):
    mon = Monitor(run="boom", transport="off")
    sent: list = []
    mon.timer._emit = lambda step: sent.append(step.as_record())
    with pytest.raises(RuntimeError), mon.step():
        raise RuntimeError("OOM")
    with mon.step():
        pass
    mon.close()
    assert [r["step"] for r in sent] == [0]


def test_a_non_finite_loss_becomes_an_event_once(hook_env):
    mon = Monitor(run="nan", transport="off")
    queued: list[tuple[str, dict]] = []
    mon.shipper.put = lambda kind, rec: queued.append((kind, rec))
    for _ in range(3):
        with mon.step():
            mon.log(loss=float("nan"), grad_norm=torch.tensor(1.5))
    mon.flush()
    steps = [r.as_record() for k, r in queued if k == "steps"]
    events = [r for k, r in queued if k == "events"]
    assert [s["metrics"] for s in steps] == [{"grad_norm": 1.5}] * 3
    assert [(e["kind"], e["severity"], e["step"]) for e in events] == [("hook", "warning", 0)]
    assert "loss is not a finite number" in events[0]["message"]
    assert all(wire.validate(wire.Event, e) for e in events)


@pytest.mark.parametrize(("name", "dtype", "peak"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H200", "fp8", 1979e12),
    ("NVIDIA GH200 480GB", "bf16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-SXM4-80GB", "fp8", None),  # Ampere has no fp8 tensor cores: unknown, not a guess
    ("NVIDIA A10G", "bf16", 125e12),
    ("NVIDIA B200", "bf16", 2250e12),
    ("NVIDIA L40S", "bf16", 362e12),
    ("NVIDIA L4", "fp16", 121e12),
    ("Tesla V100-SXM2-32GB", "fp16", 125e12),
    ("Tesla V100-PCIE-16GB", "fp16", 112e12),
    ("Some Future GPU", "bf16", None),
])
def test_peak_flops_by_gpu_name_and_dtype(name, dtype, peak):
    assert meta.peak_flops(name, dtype) == (pytest.approx(peak) if peak else None)


def test_dtype_names_from_torch_strings_and_lightning_flags():
    assert [meta.dtype_name(d) for d in (torch.bfloat16, "16-mixed", "bf16-mixed", torch.float32, None)] == [
        "bf16", "fp16", "bf16", "fp32", None]


def test_identity_comes_from_torchrun_then_slurm_then_defaults():
    assert meta.identity({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}) == meta.Identity(5, 16, 1, "torchrun")
    assert meta.identity({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3"}) == meta.Identity(
        3, 8, 3, "slurm")
    assert meta.identity({}) == meta.Identity(0, 1, None, "default")
    assert meta.default_run_name({"SLURM_JOB_ID": "4242"}) == "slurm-4242"
    assert meta.default_run_name({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert meta.default_run_name({"CLUSTERDX_RUN": "my run!"}) == "my-run-"


def test_relevant_env_puts_nccl_first_drops_secrets_and_fits_the_wire():
    env = {f"CUDA_VAR_{i:03d}": "x" for i in range(100)}
    env.update(NCCL_IB_HCA="mlx5", NCCL_SOCKET_IFNAME="eth0", NCCL_API_KEY="k", HOME="/root", FI_PROVIDER="efa")
    got = meta.relevant_env(env)
    assert list(got)[:2] == ["NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"] and len(got) == 64
    assert "NCCL_API_KEY" not in got and "HOME" not in got


def test_batch_size_of_tensors_tuples_and_dicts():
    x = torch.zeros(6, 3)
    assert [batch_size(b) for b in (x, (x, x), {"input_ids": x}, [[x]], "text", torch.tensor(1.0))] == [
        6, 6, 6, 6, None, None]


def test_configuration_mistakes_are_reported_not_raised():
    cfg = Config.from_env({"CLUSTERDX_HOOK_TRANSPORT": "udp", "CLUSTERDX_AGENT_ADDR": "nowhere",
                           "CLUSTERDX_SERVER": "http://x", "CLUSTERDX_TOKEN_FILE": "/nonexistent/token"})
    assert cfg.mode == "auto" and cfg.agent_addr == wire.LOCAL_HOOK_ADDR and cfg.token is None
    assert len(cfg.problems) == 4
    assert Config.from_env({"CLUSTERDX_AGENT_ADDR": "10.0.0.7:9000"}).agent_addr == ("10.0.0.7", 9000)


def test_a_tensor_logged_after_the_step_waits_for_its_own_copy_and_a_late_step_drops_it():
    records: list[dict] = []
    clock = LateClock()
    timer = StepTimer("r", 0, lambda step: records.append(step.as_record()), clock=clock, max_pending=1)
    timer.begin()
    timer.end()
    for mark in clock.marks:
        mark.done = True  # the step's own events are done...
    timer.log({"loss": torch.tensor(2.0)}, device_copies=True)  # ...but this copy was queued after them
    timer.poll()
    assert records == []
    clock.complete_all()
    timer.poll()
    assert records[0]["metrics"] == {"loss": 2.0}
    for _ in range(2):  # the GPU never gets there: the first step is shipped late, without the unread copy
        timer.begin()
        timer.end()
        timer.log({"loss": torch.tensor(3.0), "lr": 0.1}, device_copies=True)
    timer.begin()
    assert records[1]["metrics"] == {"lr": 0.1} and "compute_s" not in records[1]


def test_cuda_memory_is_read_at_most_once_a_second_and_reported_with_the_total():
    from types import SimpleNamespace

    from trainer_hooks.monitor import _MemoryProbe

    reads: list[str] = []
    cuda = SimpleNamespace(memory_allocated=lambda d: reads.append("a") or 3 << 30,
                           memory_reserved=lambda d: reads.append("r") or 4 << 30)
    probe = _MemoryProbe(SimpleNamespace(cuda=cuda), "cuda:0", 80 << 30)
    records: list[dict] = []
    timer = StepTimer("r", 0, lambda step: records.append(step.as_record()))
    timer.set_memory_probe(probe)
    for _ in range(3):
        timer.begin()
        timer.end()
    timer.poll()
    assert reads == ["a", "r"]  # three steps, one read of torch's allocator statistics
    assert {(r["mem_allocated_bytes"], r["mem_reserved_bytes"], r["mem_total_bytes"]) for r in records} == {
        (3 << 30, 4 << 30, 80 << 30)}
    assert all(wire.validate(wire.Step, r) for r in records)
