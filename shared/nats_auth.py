"""Who may do what on the bus: one NATS user per role, each allowed only the subjects its job needs.

Whoever can write the routing artifact steers all traffic; whoever can send migrate requests moves experts;
whoever can publish as an engine shapes routing and placement. So every party gets its own user:

- an engine (`engine-<id>`) publishes only under its own `<prefix>.engine.<id>.` (plus routing samples; its
  KV-cache events, `<prefix>.engine.<id>.kv`, included),
  listens only to its own migrate/layout requests and the announce broadcast, and may answer what it is asked
  (`allow_responses`); it has no JetStream administration at all;
- only `fit` may write the routing artifact (`$KV.<prefix>-router.>`);
- only `placement` (and the token-guarded API's reapply) publishes plans; only `migration` sends migrate
  requests; `readonly` (dashboards) only reads;
- the `gateway` (in the request path, so the most exposed service) asks the router (`route.dp`,
  `route.decode`) or decides in-process: it listens to engine hellos, telemetry (liveness), prefill signatures,
  KV-cache events and every replica's decisions, and reads the routing artifact one message at a time (no
  consumer, no write); a replica's own user (`gateway-<id>`, `nats-config --gateways`) also publishes its own
  decisions, under its own id only. Beyond that it writes nothing anyone acts on except the announce broadcast.

Replies go to a per-user inbox (`_INBOX_<user>.`), so no party can read another's replies. The control-plane
services may create and update the contract's streams (every replica sets them up idempotently on start);
nobody but `admin` may delete or purge them. A durable consumer (`Subjects.durables`) belongs to one role:
only that role may create, update, inspect, pull from, acknowledge on or delete it; every other consumer is
ephemeral, only on streams that hold no durable and only for a service that reads that stream through one
(`Roles.ephemeral`): the read roles (`readonly`, `loadgen`), `migration` and `fleet` create none; they read
single messages (see `_stream_read` for why).

`render_server_config` turns this into a nats-server configuration (see `switchyard nats-config`).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from switchyard.shared.errors import ConfigError
from switchyard.shared.subjects import Subjects, check_token

#: The roles of `switchyard nats-config`. `engine` roles are per engine id (`engine-<id>`); `fleet` is the
#: simulated fleet process, which speaks for all its engines.
SERVICE_ROLES = ("admin", "router", "placement", "migration", "fit", "api", "readonly", "loadgen", "gateway")


@dataclass(frozen=True)
class Permissions:
    """What one NATS user may publish and subscribe to."""

    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    #: May publish to the reply subject of a request it received (once): how a service answers.
    allow_responses: bool = False

    def to_conf(self) -> str:
        def quoted(items: list[str]) -> str:
            return "[" + ", ".join(json.dumps(s) for s in items) + "]"

        parts = [f"publish: {{ allow: {quoted(self.publish)} }}", f"subscribe: {{ allow: {quoted(self.subscribe)} }}"]
        if self.allow_responses:
            parts.append("allow_responses: { max: 1 }")
        return "{ " + ", ".join(parts) + " }"


def inbox_prefix(user: str) -> str:
    """The reply-subject prefix of one user (its subscribe permission covers only this)."""
    return f"_INBOX_{check_token(user, 'NATS user')}"


def engine_user(engine_id: str) -> str:
    return f"engine-{check_token(engine_id, 'engine id')}"


def gateway_user(replica_id: str) -> str:
    """One gateway replica's own user: the only one that may publish that replica's decisions."""
    return f"gateway-{check_token(replica_id, 'gateway id')}"


def epp_user(replica_id: str) -> str:
    """One endpoint picker's own user (`switchyard epp`): the only one that may publish that picker's decisions."""
    return f"epp-{check_token(replica_id, 'picker id')}"


def _stream_read(stream: str, *, own: list[str], ephemeral: bool) -> list[str]:
    """JetStream API subjects to read a stream: its info and single messages; consumers of the reader's own.

    `own`: the durable consumers (names) this role owns on the stream: it alone may create and update each
    (`CONSUMER.CREATE.<stream>.<name>[.<filter>]`, `CONSUMER.DURABLE.CREATE.<stream>.<name>`, where the server
    holds the request's name to the subject's), inspect it, pull from it, acknowledge on it and delete it.

    `ephemeral`: ephemeral consumers (the nameless `CONSUMER.CREATE.<stream>`, what nats-py sends for ordered
    consumers and KV watches), their info, flow control and delete. Never on a stream that holds a durable:
    that request carries the consumer's name in its body, never in its subject, and nats-server (2.15) takes
    a `name` there as create-or-update of whatever consumer has it, a durable included. Nor for a role that
    does not read the stream through one: a push consumer's deliver subject is in the body too, and the server
    delivers the stream's messages there whatever the creator may publish, so any ephemeral consumer can relay
    stored bytes onto any subject.
    """
    api = "$JS.API"
    subjects = [
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
    ]
    if ephemeral:
        subjects += [
            f"{api}.CONSUMER.CREATE.{stream}",
            f"{api}.CONSUMER.INFO.{stream}.*",
            f"{api}.CONSUMER.DELETE.{stream}.*",
            f"$JS.FC.{stream}.>",
        ]
    for name in own:
        subjects += [
            f"{api}.CONSUMER.CREATE.{stream}.{name}",
            f"{api}.CONSUMER.CREATE.{stream}.{name}.>",
            f"{api}.CONSUMER.DURABLE.CREATE.{stream}.{name}",
            f"{api}.CONSUMER.INFO.{stream}.{name}",
            f"{api}.CONSUMER.MSG.NEXT.{stream}.{name}",
            f"{api}.CONSUMER.DELETE.{stream}.{name}",
            f"$JS.ACK.{stream}.{name}.>",
        ]
    return subjects


def _stream_admin(stream: str) -> list[str]:
    return [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}"]


class Roles:
    """The permissions of every role for one subject prefix."""

    def __init__(self, subjects: Subjects) -> None:
        self.s = subjects
        self.kv_stream = f"KV_{subjects.router_bucket}"
        self.contract_streams = [*subjects.streams(), f"KV_{subjects.lease_bucket}"]
        s = subjects
        #: Where each service reads through ephemeral consumers, and nowhere else: any such consumer can relay
        #: the stream's bytes onto a subject of its creator's choosing (`_stream_read`), so only the service
        #: that needs it gets one. (Leases, plans and calibration requests are read without one.)
        self.ephemeral: dict[str, set[str]] = {
            "router": {self.kv_stream},  # watching the routing artifact, and its history
            "api": {self.kv_stream},  # the artifact's history (last valid revision)
            "placement": {s.expert_load_stream},  # following the expert-load windows
            "fit": {s.routing_samples_stream, s.legacy_routing_samples_stream, self.kv_stream},
        }

    def _read(self, role: str, stream: str) -> list[str]:
        """`role`'s read rights on `stream`: the durables it owns there, ephemeral consumers if it reads it
        through them (never where a durable is)."""
        durables = [d for d in self.s.durables() if d.stream == stream]
        own = [d.name for d in durables if d.role == role]
        ephemeral = stream in self.ephemeral.get(role, set()) and not durables
        return _stream_read(stream, own=own, ephemeral=ephemeral)

    def _service(self, user: str, publish: list[str], subscribe: list[str], *, admin: bool = True) -> Permissions:
        """A control-plane service: its subjects, its inbox, read (and set up) the contract's streams.

        `admin=False` (the read roles): no stream set-up."""
        js: list[str] = ["$JS.API.INFO"]
        for stream in [*self.contract_streams, self.kv_stream]:
            js += self._read(user, stream)
            if admin:
                js += _stream_admin(stream)
        return Permissions(
            publish=[*publish, *js],
            subscribe=[*subscribe, f"{inbox_prefix(user)}.>"],
            allow_responses=True,
        )

    def engine(self, engine_id: str) -> Permissions:
        s, user = self.s, engine_user(engine_id)
        return Permissions(
            publish=[f"{s.prefix}.engine.{engine_id}.>", s.routing_samples],
            # expert_load: a vLLM engine core reads its own worker's windows back (Gimbal's expert pressure).
            subscribe=[
                s.migrate(engine_id),
                s.layout(engine_id),
                s.expert_load(engine_id),
                s.announce,
                f"{inbox_prefix(user)}.>",
            ],
            allow_responses=True,
        )

    def gateway(self, replica_id: str | None) -> Permissions:
        """A gateway: the shared `gateway` user (`replica_id` None), or one replica's own (`gateway-<id>`).

        No `_service`: it answers no request and creates no consumer. It asks the router (the remote shape,
        `sy.route.dp`/`decode`, with progress reports) or decides in-process, for which it reads what the router
        reads: engines' hellos, telemetry, signatures and KV events, every replica's decisions, and the routing
        artifact by single-message reads of its bucket (never a consumer, which could relay the stored artifact
        onto a subject of its choosing). Only a replica's own user may publish decisions, and only under its own
        id: no gateway can make the others count work it did not send. Each user reports progress only on its own
        `sy.route.progress.<user>`, which settles only the requests asked in that user's name: the shared user
        cannot end a replica's requests in the routers' ledgers.
        """
        s = self.s
        user = "gateway" if replica_id is None else gateway_user(replica_id)
        publish = [s.route_dp, s.route_decode, s.progress(user), s.announce]
        publish += _stream_read(self.kv_stream, own=[], ephemeral=False)
        if replica_id is not None:
            publish.append(s.decided("gateway", replica_id))
        engines = [s.all_hello, s.all_telemetry, s.all_signatures, s.all_kv_events]
        return Permissions(publish=publish, subscribe=[*engines, s.route_decided, f"{inbox_prefix(user)}.>"])

    def epp(self, replica_id: str) -> Permissions:
        """An endpoint picker (`epp-<id>`, `nats-config --epps`): it decides in-process as a gateway replica does, so
        it reads what a gateway reads, and publishes only its own decisions (`sy.route.decided.gateway.<id>`; a picker
        id may not also be a gateway id) and announce requests (asking a silent engine for its hello). It asks no
        router and reports no progress (its core settles its own requests)."""
        s = self.s
        publish = [s.decided("gateway", replica_id), s.announce]
        publish += _stream_read(self.kv_stream, own=[], ephemeral=False)
        engines = [s.all_hello, s.all_telemetry, s.all_signatures, s.all_kv_events]
        inbox = f"{inbox_prefix(epp_user(replica_id))}.>"
        return Permissions(publish=publish, subscribe=[*engines, s.route_decided, inbox])

    def fleet(self, engine_ids: list[str]) -> Permissions:
        """The simulated fleet (one process for many engines): its engines' rights plus the sim subjects."""
        s = self.s
        publish = [s.routing_samples, s.route_decode, s.sim_completed]
        subscribe = [s.announce, f"{s.prefix}.sim.submit.*"]  # one subscription for all its prefill engines
        for engine_id in engine_ids:
            publish.append(f"{s.prefix}.engine.{check_token(engine_id, 'engine id')}.>")
            subscribe += [s.migrate(engine_id), s.layout(engine_id)]
        return self._service("fleet", publish, subscribe)

    def role(self, name: str) -> Permissions:
        s = self.s
        engines = [s.all_hello, s.all_telemetry]
        if name == "admin":
            return Permissions(publish=[">"], subscribe=[">"], allow_responses=True)
        if name == "router":
            routes = [s.route_decode, s.route_dp, s.route_decided, s.route_progress]
            return self._service(
                name,
                [s.all_decided_by("router"), s.announce],
                [*engines, s.all_kv_events, s.all_signatures, *routes],
            )
        if name == "placement":
            layout = f"{s.prefix}.engine.*.layout"
            leases = f"$KV.{s.lease_bucket}.>"
            return self._service(name, [s.placement_plan, s.announce, layout, leases], [*engines, s.all_expert_load])
        if name == "migration":
            requests = [f"{s.prefix}.engine.*.migrate", f"{s.prefix}.engine.*.layout", f"$KV.{s.lease_bucket}.>"]
            return self._service(name, [*requests, s.announce], engines)
        if name == "fit":
            # It also reads the routing samples' stream of before the rename, where a deployed bus still has it.
            legacy = self._read(name, s.legacy_routing_samples_stream)
            return self._service(name, [f"$KV.{s.router_bucket}.>", s.announce, *legacy], engines)
        if name == "api":
            # The API's write endpoints (calibrate, reapply a plan) are guarded by its token.
            return self._service(name, [s.calibration_request, s.placement_plan, s.announce], engines)
        if name == "readonly":
            # Announce only asks engines to repeat their hello: what a dashboard needs to fill its view.
            return self._service(name, [s.announce], [*engines, s.route_decided, s.sim_completed], admin=False)
        if name == "gateway":
            return self.gateway(None)
        if name == "loadgen":
            return self._service(name, [f"{s.prefix}.sim.submit.*"], [s.sim_completed], admin=False)
        raise ValueError(f"unknown role {name!r}; choose from {', '.join(SERVICE_ROLES)}, fleet, engine-<id>")


@dataclass
class Credentials:
    """User names and passwords per role, as `switchyard nats-config` writes them (a JSON file, mode 0600)."""

    users: dict[str, dict[str, str]]

    @classmethod
    def generate(cls, roles: list[str]) -> Credentials:
        return cls({role: {"user": role, "password": secrets.token_urlsafe(24)} for role in roles})

    @classmethod
    def from_environment_references(cls, roles: list[str]) -> Credentials:
        """Passwords as `$SWITCHYARD_NATS_PASSWORD_<ROLE>` references, for a configuration that holds none."""
        return cls({role: {"user": role, "password": "$" + password_variable(role)} for role in roles})

    @classmethod
    def load(cls, path: Path) -> Credentials:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read NATS credentials {path}: {exc}") from exc
        if not isinstance(raw, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("user"), str) and isinstance(v.get("password"), str)
            for v in raw.values()
        ):
            raise ValueError(f"NATS credentials {path}: expected {{role: {{user, password}}}}")
        return cls(raw)

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(json.dumps(self.users, indent=2) + "\n")


def _conf_value(value: str) -> str:
    """A quoted string, or a bare `$VARIABLE` reference (nats-server substitutes it from the environment)."""
    return value if re.fullmatch(r"\$[A-Z][A-Z0-9_]*", value) else json.dumps(value)


def password_variable(role: str) -> str:
    """The environment variable the shipped configuration reads `role`'s password from."""
    return "SWITCHYARD_NATS_PASSWORD_" + re.sub(r"[^A-Za-z0-9]", "_", role).upper()


def render_authorization(
    subjects: Subjects, credentials: Credentials, *, fleet_engines: list[str] | None = None
) -> str:
    """The `authorization { users = [...] }` block: one user per role in `credentials`, with its permissions.

    Roles named `engine-<id>` get that engine's permissions; `fleet` the simulated fleet's for `fleet_engines`.
    """
    roles = Roles(subjects)
    users = []
    for role, creds in credentials.users.items():
        if role.startswith("engine-"):
            permissions = roles.engine(role.removeprefix("engine-"))
        elif role.startswith("gateway-"):
            permissions = roles.gateway(role.removeprefix("gateway-"))
        elif role.startswith("epp-"):
            permissions = roles.epp(role.removeprefix("epp-"))
        elif role == "fleet":
            permissions = roles.fleet(fleet_engines or [])
        else:
            permissions = roles.role(role)
        users.append(
            f"    {{ user: {json.dumps(creds['user'])}, password: {_conf_value(creds['password'])},\n"
            f"      permissions: {permissions.to_conf()} }}"
        )
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"


def render_server_config(
    subjects: Subjects,
    credentials: Credentials,
    *,
    fleet_engines: list[str] | None = None,
    listen: str = "127.0.0.1:4222",
    monitor: str | None = "127.0.0.1:8222",
    store_dir: str = "/var/lib/nats/jetstream",
    max_payload: int = 8 * 1024 * 1024,
    max_file_store: int,
    tls: dict[str, str] | None = None,
) -> str:
    """A complete nats-server configuration: loopback listener, JetStream, and `render_authorization`.

    `max_file_store` (`stream_limits.file_store_bytes`) holds the contract's bounded streams: the server then
    never fills its disk, and the streams' reservations of their `max_bytes` fit.
    """
    lines = [
        "# Generated by `switchyard nats-config`: one user per role, each allowed only its own subjects.",
        "# It holds the passwords: keep it readable by the server only (mode 0600).",
        f"listen: {json.dumps(listen)}",
        *([f"http: {json.dumps(monitor)}"] if monitor else []),
        f"max_payload: {max_payload}",
        "max_pending: 67108864",
        f"jetstream {{\n  store_dir: {json.dumps(store_dir)}\n  max_memory_store: 268435456\n"
        f"  max_file_store: {max_file_store}  # the contract's stream bounds and a quarter (SWITCHYARD_STREAM_*)\n}}",
        render_authorization(subjects, credentials, fleet_engines=fleet_engines),
    ]
    if tls:
        body = "\n".join(f"  {key}: {json.dumps(value)}" for key, value in tls.items())
        lines.append(f"tls {{\n{body}\n  verify: true\n}}")
    return "\n".join(lines) + "\n"


def replica_role(credentials: Path | None, own: str) -> tuple[str, bool]:
    """The NATS user an in-process decider (a gateway replica, an endpoint picker) connects as, and whether it may
    publish its decisions: its own user `own` when the per-role credentials file has one, else the shared `gateway`
    user, which may not (no replica may publish under another's id). Without per-role credentials: `gateway`,
    sharing. An unreadable file is a `ConfigError`."""
    if credentials is None:
        return "gateway", True
    try:
        users = Credentials.load(credentials).users
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return (own, True) if own in users else ("gateway", False)
