"""The report of `make chaos` (`bench/chaos.py`): the table, the notes and the closing line.

`Reporting` is mixed into `chaos.Chaos` for the notes read from the run's own logs (the production shape, the
gateways' routing shape, nats-server's permission violations, the restarted router's startups); `table`,
`totals` and `closing_line` turn the scored `FaultResult`s and the `Audit` into what `make chaos` prints:

  chaos: <faults> faults, lost <n>, duplicated <n>, stuck <n>, misrouted <n>, max resume <s> s
"""

from __future__ import annotations

import json
from collections import Counter

from chaos_audit import Audit, FaultResult
from chaos_faults import gateway_user_of


class Reporting:
    """The report half of `chaos.Chaos` (a mixin: notes from the run's logs and records)."""

    def _shape(self) -> str:
        kinds = ("router", "placement", "migration", "gateway", "api")
        replicas = Counter(name.split("-")[0] for name in self.procs if name.split("-")[0] in kinds)
        listed = len(json.loads(self.manifest_file.read_text()))
        return (
            f"production shape: {len(self.credentials.users)} NATS users (one per role and engine; each process "
            f"holds only its own), signed routing artifacts, an engine manifest of {listed} engines; replicas: "
            + ", ".join(f"{kind} {n}" for kind, n in replicas.items())
        )

    def _gateway_shape(self) -> str:
        """Which gateway shape the HTTP load went through, as the gateways' own logs say (`serving ... (routing
        <shape>)` at each start), and whether any of them could not share its decisions."""
        names = [name for name in self.procs if name.split("-")[0] == "gateway"]
        starts: Counter[str] = Counter()
        unshared = 0
        for name in names:
            path = self.root / "logs" / f"{name}.log"
            for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
                if "serving OpenAI endpoints" in line and "(routing " in line:
                    starts[line.rsplit("(routing ", 1)[1].rstrip(")")] += 1
                unshared += "may not publish decisions" in line
        seen = ", ".join(f"{shape} {n}" for shape, n in starts.most_common()) or "none logged"
        how = (
            "each decides in-process (the router's core inside the gateway) and shares its decisions as "
            + ", ".join(gateway_user_of(name) for name in names)
            if self.o.gateway_router == "inprocess"
            else "each asks the routers over sy.route.dp (remote)"
        )
        return (
            f"gateway load: HTTP clients -> {len(names)} gateways -> stub DP engines; {how}; gateway starts by "
            f"routing: {seen}; 'may not publish decisions' warnings: {unshared}"
        )

    def _violations(self) -> list[str]:
        """nats-server's permission violations over the whole run, by connection name and subject; and, in a note
        of their own, the replies a restarted server refused.

        A responder may publish one reply to a request's inbox (`allow_responses`), a permission the server grants
        as it delivers the request. A server restarted in between has no record of it, so a reply to a request
        delivered before the restart is refused on the inbox (the requester's timeout and resend cover it). Those
        (an `_INBOX_` subject, logged after the node's second start) are not a role overstepping its permissions.
        """
        found: Counter[str] = Counter()
        late = 0
        for node in range(len(self.nats_nodes)):
            starts = 0
            for line in self._server_log_since(0, node):
                if "Server is ready" in line:
                    starts += 1
                elif "Violation" in line:
                    name = line.split('"')[1].rsplit(":", 1)[-1] if line.count('"') >= 2 else "unnamed"
                    subject = line.rsplit("Subject", 1)[-1].strip(' :"') if "Subject" in line else "?"
                    if starts > 1 and subject.startswith("_INBOX_"):
                        late += 1
                        continue
                    found[f"{name} on {subject}"] += 1
        notes = [
            "nats-server permission violations: "
            + (", ".join(f"{k} ({n})" for k, n in found.most_common(8)) if found else "none")
        ]
        if late:
            notes.append(
                f"replies refused by a restarted nats-server (to requests delivered before the restart): {late}"
            )
        return notes

    def _gateway_clients(self, r: FaultResult) -> str:
        """What the clients through the gateways saw in window `r` (its note): for the gateway fault, what the
        SIGKILL cost them; for the router fault, whether the gateways' load depended on the router at all."""
        seen = f"{r.gw_sent} requests, {r.gw_failed} first attempts failed, {r.gw_lost} lost"
        if r.name == "gateway":
            back = f"; attempts answered 200 again {r.gw_resume_s:.2f} s after the SIGKILL" if r.gw_failed else ""
            return f"; clients through the {self.o.gateway_router} gateways: {seen}{back}"
        if self.o.gateway_router == "inprocess":
            return f"; the gateways decide in-process (their load does not go through the router): {seen}"
        return f"; the gateways ask the router (remote): {seen}"

    def _router_startups(self) -> list[str]:
        """The restarted router's own account of each restart (`process up ... s: connect ...`), in order."""
        path = self.root / "logs" / "router.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return [line.split("process up ", 1)[1] for line in lines if "process up " in line][1:]


def totals(results: list[FaultResult], audit: Audit) -> dict[str, float]:
    return {
        "faults": len(results),
        "lost": sum(r.lost + r.gw_lost + r.lost_rows for r in results) + audit.samples_lost,
        "duplicated": sum(r.duplicated for r in results) + audit.samples_duplicated,
        "stuck": sum(r.stuck for r in results),
        "misrouted": sum(r.misrouted for r in results),
        # Routing's resume and the API's (the first answer after it stopped answering, from the fault).
        "max_resume_s": max((max(r.resume_s, r.api_resume_s) for r in results), default=0.0),
    }


def closing_line(results: list[FaultResult], audit: Audit) -> str:
    t = totals(results, audit)
    return (
        f"chaos: {t['faults']} faults, lost {t['lost']}, duplicated {t['duplicated']}, stuck {t['stuck']}, "
        f"misrouted {t['misrouted']}, max resume {t['max_resume_s']:.1f} s"
    )


def table(results: list[FaultResult]) -> str:
    head = (
        f"{'fault':<17}{'requests':>9}{'retried':>8}{'lost':>6}{'probes':>8}{'failed':>8}{'resume s':>10}"
        f"{'misrouted':>11}{'api resume s':>13}{'api 5xx':>8}"
        f"{'gw req':>7}{'gw fail':>8}{'gw lost':>8}{'gw resume s':>12}"
        f"{'plans':>7}{'migr.':>7}{'rows lost':>10}{'dup':>5}{'stuck':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.name:<17}{r.sent:>9}{r.retried:>8}{r.lost:>6}{r.probes:>8}{r.probe_failures:>8}{r.resume_s:>10.2f}"
            f"{r.misrouted:>11}{r.api_resume_s:>13.2f}{r.api_500:>8}"
            f"{r.gw_sent:>7}{r.gw_failed:>8}{r.gw_lost:>8}{r.gw_resume_s:>12.2f}"
            f"{r.placements:>7}{r.migrations:>7}{r.lost_rows:>10}{r.duplicated:>5}{r.stuck:>7}"
        )
    lines += [f"{r.name}: {r.note}" for r in results]
    return "\n".join(lines)
