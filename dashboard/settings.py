"""Django settings, read from the environment through the strict helpers in :mod:`dashboard.envconf`.

Embedded default (nothing set): SQLite in WAL mode under ``CLUSTERDX_DATA_DIR``, an in-process channel layer and live
state, Celery tasks run in-process by the embedded scheduler. ``DATABASE_URL`` switches to PostgreSQL, ``REDIS_URL`` to
Redis for the channel layer, the Celery broker and the live state.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import plotly

from dashboard.envconf import (
    database_from_url,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_oidc,
    env_str,
    private_dir,
    private_file,
    read_or_create_secret,
)

BASE_DIR = Path(__file__).resolve().parent
# 0700: it holds the secret key and the SQLite file (webhook secrets, PagerDuty routing keys).
DATA_DIR = private_dir(Path(env_str("CLUSTERDX_DATA_DIR", str(Path.cwd() / "var"))).resolve())


def _secret_key() -> str:
    key = env_str("SECRET_KEY")
    if key:
        return key
    # Embedded default: one random key per data directory, kept so sessions survive a restart.
    return read_or_create_secret(DATA_DIR / "secret_key", lambda: secrets.token_urlsafe(50))


SECRET_KEY = _secret_key()
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")
SITE_URL = env_str("SITE_URL", "http://localhost:8000").rstrip("/")

# Served over HTTPS (behind a TLS-terminating proxy): cookies only over TLS, HSTS, and the proxy's
# X-Forwarded-Proto believed, so request.is_secure() (HSTS, CSRF's origin check, wss:// in the CSP) sees https.
HTTPS = SITE_URL.lower().startswith("https://") and not DEBUG
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = HTTPS
SECURE_HSTS_SECONDS = env_int("CLUSTERDX_HSTS_SECONDS", 31_536_000, min=0) if HTTPS else 0
if HTTPS and env_bool("CLUSTERDX_TRUST_X_FORWARDED_PROTO", True):
    # Only safe when the proxy sets (or strips) this header: set the variable to false when nothing does.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "dashboard.telemetry",
    "dashboard.ingest",
    "dashboard.live",
    "dashboard.web",
    "dashboard.api",
    "dashboard.diagnosis",
    "dashboard.doctor",
    "dashboard.alerts",
    "dashboard.accounts",
    "dashboard.storage",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "dashboard.security.ContentSecurityPolicy",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "dashboard.accounts.middleware.PersonalTokenAuth",
    "dashboard.security.LoginThrottle",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "dashboard.urls"
ASGI_APPLICATION = "dashboard.asgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "dashboard.web.context.assets",
            ]
        },
    }
]

DATABASE_URL = env_str("DATABASE_URL")
if DATABASE_URL:
    DATABASES = {"default": database_from_url(DATABASE_URL, env_int("CLUSTERDX_DB_POOL_SIZE", 10, min=1))}
    DATABASES["default"]["TEST"] = {"NAME": f"test_{DATABASES['default']['NAME']}_{os.getpid()}"}
else:
    SQLITE_PATH = Path(env_str("CLUSTERDX_SQLITE_PATH", str(DATA_DIR / "clusterdx.sqlite3")))
    # Created 0600 before SQLite opens it; SQLite gives its -wal and -shm files the database file's mode.
    for _db_file in (SQLITE_PATH, SQLITE_PATH.with_name(SQLITE_PATH.name + "-wal"),
                     SQLITE_PATH.with_name(SQLITE_PATH.name + "-shm")):
        if _db_file == SQLITE_PATH or _db_file.exists():
            private_file(_db_file)
    DATABASES = {
        "default": {
            "ENGINE": "dashboard.storage.sqlite",  # Django's, with a fair in-process write lock (its docstring)
            "NAME": str(SQLITE_PATH),
            "OPTIONS": {
                # WAL lets the pages read while ingest writes; IMMEDIATE takes the write lock up front so two
                # writers queue on busy_timeout instead of failing with "database is locked" mid-transaction.
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
            },
            # A file (not :memory:) so servers in threads and subprocesses of the tests see the same data; one per
            # test process so concurrent runs on one machine never share it.
            "TEST": {"NAME": str(DATA_DIR / f"test-clusterdx-{os.getpid()}.sqlite3")},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            # A blocking pop shorter than the socket read timeout (dashboard/live/layer.py says why).
            "BACKEND": "dashboard.live.layer.ChannelLayer",
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 15.0}],
                       "prefix": env_str("CLUSTERDX_REDIS_PREFIX", "clusterdx"),
                       "capacity": 2000, "expiry": 30},
        }
    }
else:
    # In-process, messages shared rather than deep-copied per browser (dashboard/live/layer.py says why).
    CHANNEL_LAYERS = {"default": {"BACKEND": "dashboard.live.layer.LocalChannelLayer", "CONFIG": {"capacity": 2000}}}

# The cache holds the failed sign-in counts: in-process embedded, shared by every server process with Redis.
if REDIS_URL:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
                          "KEY_PREFIX": env_str("CLUSTERDX_REDIS_PREFIX", "clusterdx")}}

# Celery: Redis broker in production; embedded, tasks run in-process (the embedded scheduler calls the same tasks).
CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_ALWAYS_EAGER = not REDIS_URL
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "clusterdx"
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env_int("CLUSTERDX_VISIBILITY_TIMEOUT_S", 120, min=10),
    # Two deployments (or two test runs) sharing one Redis database must not redeliver each other's tasks.
    "global_keyprefix": env_str("CLUSTERDX_REDIS_PREFIX", "clusterdx") + ":",
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"
# Single sign-on (docs/sso.md): OpenID Connect when CLUSTERDX_OIDC_CLIENT_ID is set, beside the local accounts. The
# SSO backend answers only an OIDC callback, and builds no network call when Django loads it for a session.
CLUSTERDX_OIDC = env_oidc()
AUTHENTICATION_BACKENDS = ["django.contrib.auth.backends.ModelBackend", "dashboard.sso.Backend"]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # whitenoise warns at start-up when it is missing
# plotly.js comes from the installed plotly package (these machines are offline; never a CDN).
STATICFILES_DIRS = [("vendor/plotly", str(Path(plotly.__file__).parent / "package_data"))]
# plotly's cartesian bundle (scatter, bar, heatmap: 1.5 MB instead of 4.8), installed from the npm registry by
# scripts/bootstrap.sh (and the image's build stage): the pages whose first paint is a chart load it when it is there.
PLOTLY_CARTESIAN_DIR = Path(__file__).resolve().parent / "web" / "npm" / "node_modules" / "plotly.js-cartesian-dist-min"
if (PLOTLY_CARTESIAN_DIR / "plotly-cartesian.min.js").is_file():
    STATICFILES_DIRS.append(("vendor/plotly-cartesian", str(PLOTLY_CARTESIAN_DIR)))
# ... and its basic bundle (scatter, bar, pie: 1.2 MB, half the cartesian one's evaluation) for the pages that draw
# only lines and bars (overview, node, GPU, finding, rank, link).
PLOTLY_BASIC_DIR = PLOTLY_CARTESIAN_DIR.parent / "plotly.js-basic-dist-min"
if (PLOTLY_BASIC_DIR / "plotly-basic.min.js").is_file():
    STATICFILES_DIRS.append(("vendor/plotly-basic", str(PLOTLY_BASIC_DIR)))
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG


def _immutable(path: str, url: str) -> bool:
    # Pages ask for plotly with its version in the query (dashboard.web.context): that file never changes under its URL.
    return url.endswith(("/vendor/plotly/plotly.min.js", "/vendor/plotly-cartesian/plotly-cartesian.min.js",
                         "/vendor/plotly-basic/plotly-basic.min.js"))


WHITENOISE_IMMUTABLE_FILE_TEST = _immutable

# --- clusterdx ---------------------------------------------------------------------------------------------------
CLUSTERDX = {
    # Ingest: compressed and decompressed body limits (413 beyond).
    "INGEST_MAX_BODY_BYTES": env_int("CLUSTERDX_INGEST_MAX_BODY_BYTES", 8 * 1024 * 1024, min=1024),
    # Ingest: how far ahead of the server's clock a batch's times may be (400 clock_skew beyond).
    "INGEST_MAX_FUTURE_S": env_float("CLUSTERDX_INGEST_MAX_FUTURE_S", 300.0, min=1.0),
    # Ingest group commit (dashboard/ingest/commit.py): batches waiting per process before new ones get 429 busy,
    # the most batches one commit stores, and how long the writer waits for more before committing a short group:
    # the short window when it found none waiting, the busy one when batches were already queued as the group began
    # (a busy server: fewer, larger commits cost the writer a third less CPU a batch at 2,048 nodes, docs/scaling.md).
    "INGEST_QUEUE_BATCHES": env_int("CLUSTERDX_INGEST_QUEUE_BATCHES", 4096, min=1),
    "INGEST_COMMIT_MAX_BATCHES": env_int("CLUSTERDX_INGEST_COMMIT_MAX_BATCHES", 256, min=1),
    "INGEST_COMMIT_WINDOW_MS": env_float("CLUSTERDX_INGEST_COMMIT_WINDOW_MS", 2.0, min=0.0),
    "INGEST_COMMIT_BUSY_WINDOW_MS": env_float("CLUSTERDX_INGEST_COMMIT_BUSY_WINDOW_MS", 25.0, min=0.0),
    # Where the group writer runs (dashboard/ingest/commit.py): "thread" (in the web process) or "process" (a child
    # process that checks and stores the bodies: the embedded server's one process then uses two cores).
    "INGEST_WRITER": env_choice("CLUSTERDX_INGEST_WRITER", "thread", ("thread", "process")),
    # Each web worker (and the ingest writer process) holds its threads to one CPU of its own (dashboard/affinity.py):
    # "auto" unless a CPU quota is below the visible CPUs or a container sees all its host's CPUs, "on" regardless,
    # "off" never.
    "PIN_CPU": env_choice("CLUSTERDX_PIN_CPU", "auto", ("auto", "on", "off")),
    # Nodes per second one cluster may post: beyond it the server asks agents for a longer send_interval_s. 512: a
    # post costs about as much as a node-second of records (docs/scaling.md, "The send interval's default"), so past
    # 512 nodes two seconds a post (and past 1,024, four) keep ingest's tail under a second on two cores.
    "INGEST_NODES_PER_S": env_int("CLUSTERDX_INGEST_NODES_PER_S", 512, min=1),
    # GET /metrics (Prometheus): a scraper sends this as a bearer token; unset, only loopback and staff may read.
    "METRICS_TOKEN": env_str("CLUSTERDX_METRICS_TOKEN"),
    # Request bodies: refused with 413 from Content-Length, or cut off while streaming, before Django reads them.
    "MAX_BODY_BYTES": env_int("CLUSTERDX_MAX_BODY_BYTES", 1024 * 1024, min=1024),
    # The log doctor's upload: a 20 MB log file and the form around it.
    "DOCTOR_MAX_BODY_BYTES": env_int("CLUSTERDX_DOCTOR_MAX_BODY_BYTES", 21 * 1024 * 1024, min=1024),
    # Sign-in: this many failures per user name and address lock that pair out for the window (429).
    "LOGIN_MAX_FAILURES": env_int("CLUSTERDX_LOGIN_MAX_FAILURES", 10, min=1),
    "LOGIN_FAILURE_WINDOW_S": env_int("CLUSTERDX_LOGIN_FAILURE_WINDOW_S", 900, min=1),
    # Live: at most one websocket frame per client per this many milliseconds.
    "LIVE_FRAME_INTERVAL_MS": env_int("CLUSTERDX_LIVE_FRAME_INTERVAL_MS", 250, min=20),
    # An open live socket re-checks that its user may still see the cluster this often (closed with 4403 if not).
    "LIVE_ACCESS_RECHECK_S": env_float("CLUSTERDX_LIVE_ACCESS_RECHECK_S", 30.0, min=0.1),
    # How many recent steps a run page starts with.
    "LIVE_SNAPSHOT_STEPS": env_int("CLUSTERDX_LIVE_SNAPSHOT_STEPS", 300, min=10),
    # Time series older than this are deleted by the retention task.
    "RETENTION_HOURS": env_float("CLUSTERDX_RETENTION_HOURS", 72.0, min=0.1),
    # Raw 1 Hz GPU and host samples are kept this long (the hot window); older ranges are read from the rollups.
    "RAW_RETENTION_HOURS": env_float("CLUSTERDX_RAW_RETENTION_HOURS", 6.0, min=0.1),
    # The 10 s and 1 min rollups (min / mean / max / last per series) are kept this long.
    "ROLLUP_10S_RETENTION_DAYS": env_float("CLUSTERDX_ROLLUP_10S_RETENTION_DAYS", 7.0, min=0.1),
    "ROLLUP_1M_RETENTION_DAYS": env_float("CLUSTERDX_ROLLUP_1M_RETENTION_DAYS", 30.0, min=0.1),
    # An agent silent for this long is reported down.
    "HEARTBEAT_TIMEOUT_S": env_float("CLUSTERDX_HEARTBEAT_TIMEOUT_S", 15.0, min=1.0),
    "DIAGNOSIS_INTERVAL_S": env_float("CLUSTERDX_DIAGNOSIS_INTERVAL_S", 2.0, min=0.5),
    # A cluster's pass rests until its CPU seconds are at most this share of the time since it began: a large
    # cluster's pass takes at most this share of a core instead of running back to back (diagnosis.tasks.due).
    "DIAGNOSIS_MAX_CPU_SHARE": env_float("CLUSTERDX_DIAGNOSIS_MAX_CPU_SHARE", 0.25, min=0.01),
    # A paced cluster's next pass waits this long past due for the process that ran its last pass (and holds its
    # window) before another process takes it over (dashboard.diagnosis.tasks.due).
    "DIAGNOSIS_HANDOVER_S": env_float("CLUSTERDX_DIAGNOSIS_HANDOVER_S", 20.0, min=0.0),
    "GPU_HOUR_PRICE_USD": env_float("CLUSTERDX_GPU_HOUR_PRICE_USD", 2.5, min=0.0),
    # Outbound webhooks to private / loopback / link-local addresses are refused unless this is set.
    "ALERTS_ALLOW_PRIVATE": env_bool("CLUSTERDX_ALERTS_ALLOW_PRIVATE", False),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}},
}
