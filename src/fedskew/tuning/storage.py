"""Where ``fedskew tune`` keeps its studies: Optuna's RDB storage with heartbeats, made safe for several processes on
one SQLite file.

Optuna hands a queued (WAITING) trial to the process that sets it RUNNING first, and relies on ``SELECT ... FOR
UPDATE`` to make that claim exclusive. SQLite has no row locks and pysqlite reads outside a transaction, so two
processes can both read WAITING and both claim the trial (measured here: 4 processes popping 40 queued trials ran 51).
A retried trial (one cut off by a kill) is such a queued trial, so two ``--jobs`` workers resumed the same trial, one
failed on the other's run-directory lock, and Optuna then refused to record the other's result ("Cannot tell a FAIL
trial"). For SQLite the state changes of trials therefore take an exclusive file lock beside the database, which makes
the read-check-write of a claim atomic across the processes of the machine (SQLite itself is one machine's store);
servers with row locks (PostgreSQL, MySQL) are used as Optuna uses them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna

from fedskew.schema import ConfigError

try:
    import fcntl
except ImportError:  # Windows: no flock; the claims there are Optuna's own
    fcntl = None  # type: ignore[assignment]

HEARTBEAT_S = 60  # a running trial's process beats this often
GRACE_S = 180  # a trial that has not beaten for this long is failed and retried by the next process of the study
MAX_RETRY = 3


def retry_callback() -> Any:
    """Optuna's callback that queues a failed trial again with the same arguments (at most :data:`MAX_RETRY`
    times)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    assert fcntl is not None
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class SQLiteStudyStorage(optuna.storages.RDBStorage):
    """:class:`optuna.storages.RDBStorage` on an SQLite file whose trial-state changes are serialized by a file lock
    (``<database>.lock``), so that a queued trial is claimed by exactly one process."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self._lock_path = Path(url.removeprefix("sqlite:///") + ".lock")
        super().__init__(url, **kwargs)

    def set_trial_state_values(self, trial_id: int, state: Any, values: Any = None) -> bool:
        with _exclusive(self._lock_path):
            return super().set_trial_state_values(trial_id, state, values)


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """The storage of ``url`` (an SQLAlchemy URL), with heartbeats: a trial whose process stopped beating for
    :data:`GRACE_S` seconds is failed and retried by the next process that tunes the study, on any machine."""
    path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else ""
    on_disk = path not in ("", ":memory:")  # an SQLite file: other processes may open it too
    if on_disk:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    kind = SQLiteStudyStorage if on_disk and fcntl else optuna.storages.RDBStorage
    import sqlalchemy.exc

    try:
        with warnings.catch_warnings():  # heartbeats are marked experimental in Optuna; they are what resumption needs
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return kind(
                url,
                engine_kwargs={"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None,
                heartbeat_interval=HEARTBEAT_S,
                grace_period=GRACE_S,
                heartbeat_stale_trial_callback=retry_callback(),
            )
    except ImportError as exc:  # the URL's database driver is not installed (postgresql:// without psycopg2)
        raise ConfigError(
            f"storage {url!r}: its database driver is not installed ({exc}); e.g. a postgresql:// URL needs "
            "psycopg2 (pip install psycopg2-binary), a mysql:// one PyMySQL"
        ) from None
    except sqlalchemy.exc.NoSuchModuleError:
        kind_name = url.split(":", 1)[0]
        raise ConfigError(
            f"storage {url!r}: {kind_name!r} is not a database SQLAlchemy knows (sqlite:///FILE, postgresql://..., "
            "mysql://...)"
        ) from None
    except sqlalchemy.exc.SQLAlchemyError as exc:  # a bad URL, or a server that cannot be reached
        raise ConfigError(f"storage {url!r} cannot be opened: {type(exc).__name__}: {exc}") from None
