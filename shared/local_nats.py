"""The embedded bus of `switchyard up`, closed to other local users: per-run credentials, one user per role.

A loopback port is no boundary on a shared machine: without authorization any local process could overwrite
the routing artifact, publish plans or delete consumers. So `switchyard up` generates a password per role for
each run (the same roles and permissions as `switchyard nats-config` gives a production server, the `fleet`
role for the simulated fleet's engine ids), writes them mode 0600 to `<data dir>/nats/credentials.json`, and
starts the embedded server with that authorization block. Each component then connects as its own role
through the usual `SWITCHYARD_NATS_CREDENTIALS` mechanism; nothing has to be configured by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from switchyard.shared.embedded import EmbeddedNats
from switchyard.shared.nats_auth import SERVICE_ROLES, Credentials, engine_user, gateway_user, render_authorization
from switchyard.shared.subjects import Subjects

#: The id of `switchyard up`'s gateway child: it decides in-process and shares its decisions as its own user.
GATEWAY_ID = "up"
#: Every role a run of `switchyard up` connects as (the bootstrap as `admin`, the gateway child as
#: `gateway-up`: the shared `gateway` user may not publish decisions).
LOCAL_ROLES = (*SERVICE_ROLES, "fleet", gateway_user(GATEWAY_ID))


@dataclass(frozen=True)
class LocalBus:
    """An embedded server that takes only the run's own users, and the file that holds their passwords."""

    server: EmbeddedNats
    credentials_path: Path


def credentials_path(store_dir: Path) -> Path:
    return Path(store_dir) / "credentials.json"


def secured_embedded(
    store_dir: Path,
    subjects: Subjects,
    fleet_engines: list[str],
    *,
    engines: list[str] | None = None,
    max_payload: int = 8 * 1024 * 1024,
) -> LocalBus:
    """A not yet started embedded server with fresh per-role credentials (written mode 0600, folder 0700).

    `engines`: real engines to run beside it (`up --services-only --engines`), one `engine-<id>` user each.
    New passwords every run: a file left behind by an earlier run opens nothing once that run has stopped.
    """
    store_dir = Path(store_dir)
    store_dir.mkdir(parents=True, exist_ok=True)
    store_dir.chmod(0o700)  # the credentials, the server's config (passwords in clear) and its JetStream store
    credentials = Credentials.generate([*LOCAL_ROLES, *(engine_user(e) for e in engines or [])])
    path = credentials_path(store_dir)
    credentials.save(path)
    block = render_authorization(subjects, credentials, fleet_engines=fleet_engines)
    return LocalBus(EmbeddedNats(store_dir, max_payload=max_payload, extra_config=block), path)
