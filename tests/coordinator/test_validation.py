"""Validation by replay on the coordinator's side (issue 20): fake agents and relays speak
the real HTTP API; the rules alone are tested at the end."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import httpx
import msgspec
import pytest
from coord_helpers import HELLO, Agent, Pool, decode, make_zip, open_pool, relay_headers

from vpool.coordinator import keys, sqlite_faults, validation
from vpool.coordinator.app import create_app
from vpool.coordinator.validation import Policy, Run, Verdict
from vpool.protocol import api
from vpool.protocol.tokens import RankClaims, verify_token

TRUE, FORGED = b"pi = 3.14159\n", b"pi = 3.0\n"


def warning(lease: api.Lease, rank_root: str | None = None) -> bytes:
    """The stderr of an honest run: a warning naming the program's path as the rank saw it,
    sandboxed (``rank_root`` None) or in an agent's own rank directory, and a package of its
    environment."""
    if rank_root is None:
        app, env = "/vpool/rank/work/app.py", "/vpool/env/numpy/core.py"
    else:
        rank_dir = f"{rank_root}/{lease.job_uid}-{lease.rank}-{lease.incarnation}-k2x_9abc"
        app, env = (
            f"{rank_dir}/work/app.py",
            f"{rank_root}/../envs/0123abcd4567ef89/site/numpy/core.py",
        )
    return f'{app}:3: UserWarning: slow\n  from "{env}" line 7\n'.encode()


async def original_run(
    pool: Pool, stdout: bytes = TRUE, others: str = "bc", ranks: int = 1
) -> tuple[int, Agent, list[Agent]]:
    """A validated job run by agent-a, whose ranks exited 0 having printed ``stdout``, and
    agents named by ``others`` enrolled since (each with one slot)."""
    await pool.register_relay("relay-0")
    a = await pool.enroll("agent-a", slots=ranks)
    job = await pool.submit(ranks, validate=True)
    leases = await pool.lease(a)
    assert len(leases) == ranks
    await pool.heartbeat(a, leases)
    more = [await pool.enroll(f"agent-{c}", slots=1) for c in others]
    for lease in leases:
        await prints(pool, a, lease, stdout, "/home/alice/.vpool/ranks")
        r = await pool.exit(a, lease)
        assert r.status_code == 200, r.text
    return job.id, a, more


async def reexecution(pool: Pool, agents: list[Agent]) -> tuple[Agent, api.Lease]:
    """The one agent of ``agents`` given a re-execution, and its lease, checked."""
    got = [(agent, lease) for agent in agents for lease in await pool.lease(agent)]
    assert len(got) == 1, got
    agent, lease = got[0]
    claims = verify_token(
        lease.token, pool.core.key.public_key(), now=pool.clock(), kind=RankClaims
    )
    assert claims.validating and claims.agent == agent.id
    assert lease.from_start and lease.restore == [] and lease.checkpoint_every == 0
    await pool.heartbeat(agent, [lease])
    return agent, lease


async def prints(
    pool: Pool, agent: Agent, lease: api.Lease, stdout: bytes, rank_root: str | None = None
) -> None:
    """An honest run's output: ``stdout``, and ``warning`` on stderr."""
    await pool.output(agent, lease, "stdout", 0, stdout)
    await pool.output(agent, lease, "stderr", 0, warning(lease, rank_root))


async def replay(
    pool: Pool,
    agent: Agent,
    lease: api.Lease,
    stdout: bytes,
    *,
    agreed: bool = True,
    code: int = 0,
    stderr: bytes | None = None,
) -> None:
    """The re-execution prints ``stdout`` (and ``stderr``: by default, the honest warning,
    sandboxed) and exits with ``code``; the relay says whether its messages had the logged
    content."""
    await pool.output(agent, lease, "stdout", 0, stdout)
    await pool.output(agent, lease, "stderr", 0, warning(lease) if stderr is None else stderr)
    r = await pool.exit(agent, lease, code=code)
    assert r.status_code == 200, r.text
    await verdict(pool, lease, agreed)


async def verdict(pool: Pool, lease: api.Lease, agreed: bool) -> None:
    report = api.RelayValidated(
        name="relay-0",
        job=lease.job,
        rank=lease.rank,
        incarnation=lease.incarnation,
        agreed=agreed,
        message="" if agreed else f"rank {lease.rank} sent message seq 3 to rank 1 differing",
    )
    r = await pool.post("/api/v1/relays/validated", report, relay_headers("relay-0"))
    assert r.status_code == 200, r.text


async def stdout_of(pool: Pool, job: int) -> bytes:
    r = await pool.client.get(f"/api/v1/jobs/{job}/output?after=0", headers=pool.user())
    page = decode(r, api.OutputPage)
    return b"".join(rec.data for rec in page.records if rec.stream == "stdout")


def trust(pool: Pool, agent: Agent) -> tuple[int, int, int]:
    row = pool.core.store._one(  # type: ignore[attr-defined]
        "SELECT agreed, agreed_streak, wrong FROM agents WHERE id = ?", [agent.id]
    )
    assert row is not None
    return int(row["agreed"]), int(row["agreed_streak"]), int(row["wrong"])


async def test_an_agreeing_reexecution_on_another_agent_validates_the_job(pool: Pool) -> None:
    job, a, others = await original_run(pool)
    detail = await pool.job(job)
    assert detail.job.state == "running" and detail.job.validate
    assert detail.job.validation.startswith("validating")
    assert await stdout_of(pool, job) == b""  # not shown before it is validated
    r = await pool.client.get(f"/api/v1/jobs/{job}/results", headers=pool.user())
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_validated"
    assert await pool.lease(a) == []  # never the agent that ran it
    v, lease = await reexecution(pool, others)
    assert lease.incarnation == 2
    await replay(pool, v, lease, TRUE)
    detail = await pool.job(job)
    assert detail.job.state == "succeeded", detail.job.reason
    assert "validated: rank(s) 0 re-executed and confirmed" in detail.job.validation
    [rank] = detail.ranks
    assert (rank.validation, rank.exit_code) == ("agreed", 0)
    assert rank.validated_by == f"agent agent-{'bc'[others.index(v)]}"
    assert await stdout_of(pool, job) == TRUE
    assert trust(pool, a) == (1, 1, 0) and trust(pool, v) == (1, 1, 0)
    kinds = [e.kind for e in detail.events]
    assert kinds.index("validating") < kinds.index("rank_validating") < kinds.index("succeeded")


async def test_the_verdict_may_come_before_the_exit(pool: Pool) -> None:
    job, _, others = await original_run(pool)
    v, lease = await reexecution(pool, others)
    await verdict(pool, lease, True)
    assert (await pool.job(job)).job.state == "running"  # its exit is still to come
    await prints(pool, v, lease, TRUE)
    await pool.exit(v, lease)
    assert (await pool.job(job)).job.state == "succeeded"


async def test_forged_output_is_outvoted_and_replaced(pool: Pool) -> None:
    job, a, others = await original_run(pool, stdout=FORGED)
    v, lease = await reexecution(pool, others)
    await replay(pool, v, lease, TRUE)
    detail = await pool.job(job)
    assert detail.job.state == "running"
    assert "third time" in detail.job.validation
    assert any(
        e.kind == "validation_mismatch" and "in its stdout; a third execution decides" in e.message
        for e in detail.events
    )
    third = [o for o in others if o is not v]
    t, lease3 = await reexecution(pool, third)
    assert lease3.incarnation == 3
    await replay(pool, t, lease3, TRUE)
    detail = await pool.job(job)
    assert detail.job.state == "succeeded", detail.job.reason
    assert await stdout_of(pool, job) == TRUE  # the agreed output, never the forged one
    assert detail.ranks[0].validation == "corrected"
    assert "corrected" in detail.job.validation
    assert trust(pool, a) == (0, 0, 1)
    assert trust(pool, v)[:2] == (1, 1) and trust(pool, t)[:2] == (1, 1)
    assert any(e.kind == "agent_distrusted" and "agent-a" in e.message for e in detail.events)


async def test_forged_messages_fail_the_job_naming_the_rank_and_agents(pool: Pool) -> None:
    job, a, others = await original_run(pool, stdout=TRUE)
    v, lease = await reexecution(pool, others)
    await verdict(pool, lease, False)  # the relay stops it at its first differing message
    third = [o for o in others if o is not v]
    t, lease3 = await reexecution(pool, third)
    await verdict(pool, lease3, False)
    detail = await pool.job(job)
    assert detail.job.state == "failed"
    reason = detail.job.reason
    assert "rank 0's run on agent agent-a sent other messages" in reason
    assert "agent-b" in reason and "agent-c" in reason
    assert await stdout_of(pool, job) == TRUE  # shown, as a failed job's output is
    assert trust(pool, a) == (0, 0, 1)
    # The re-executions still running are told to stop.
    hb = await pool.heartbeat(t, [lease3])
    assert [s.rank for s in hb.stop] == [0]


async def test_a_lying_validator_is_outvoted_and_loses_trust(pool: Pool) -> None:
    job, a, others = await original_run(pool, stdout=TRUE)
    v, lease = await reexecution(pool, others)
    await replay(pool, v, lease, FORGED, code=3)
    t, lease3 = await reexecution(pool, [o for o in others if o is not v])
    await replay(pool, t, lease3, TRUE)
    detail = await pool.job(job)
    assert detail.job.state == "succeeded", detail.job.reason
    assert await stdout_of(pool, job) == TRUE
    assert detail.ranks[0].validation == "agreed" and "was wrong" in detail.ranks[0].validated_by
    assert trust(pool, v) == (0, 0, 1) and trust(pool, a) == (1, 1, 0)


async def test_three_different_runs_fail_the_job(pool: Pool) -> None:
    job, _, others = await original_run(pool, stdout=b"1\n")
    v, lease = await reexecution(pool, others)
    await replay(pool, v, lease, b"2\n")
    t, lease3 = await reexecution(pool, [o for o in others if o is not v])
    await replay(pool, t, lease3, b"3\n")
    detail = await pool.job(job)
    assert detail.job.state == "failed"
    assert "no two of three executions of rank 0 agree" in detail.job.reason


async def test_no_unrelated_agent_means_the_job_waits_and_says_why(pool: Pool) -> None:
    job, a, _ = await original_run(pool, others="")
    assert await pool.lease(a) == []
    detail = await pool.job(job)
    assert detail.job.state == "running"
    assert "waits for a free agent unrelated to agent-a" in detail.job.validation
    b = await pool.enroll("agent-b", slots=1)
    v, lease = await reexecution(pool, [b])
    await replay(pool, v, lease, TRUE)
    assert (await pool.job(job)).job.state == "succeeded"


async def test_agents_of_the_same_join_token_are_related(tmp_path: Path) -> None:
    async with open_pool(tmp_path, open_enrollment=False) as pool:
        store, now = pool.core.store, pool.clock()
        tokens = []
        for label in ("alice's machines", "bob's machine"):
            token, token_hash = keys.new_api_token(keys.JOIN_PREFIX)
            store.create_join_token(token_hash, label, now, uses=5, expires=None)
            tokens.append(token)
        await pool.register_relay("relay-0")
        a = await pool.enroll("agent-a", slots=1, join_token=tokens[0])
        job = await pool.submit(1, validate=True)
        [lease] = await pool.lease(a)
        await pool.heartbeat(a, [lease])
        sibling = await pool.enroll("agent-a2", slots=4, join_token=tokens[0])
        stranger = await pool.enroll("agent-b", slots=1, join_token=tokens[1])
        await prints(pool, a, lease, TRUE)
        await pool.exit(a, lease)
        # agent-a2 has the most free slots, but alice's machines are one vote.
        v, lease2 = await reexecution(pool, [sibling, stranger])
        assert v is stranger
        await replay(pool, v, lease2, TRUE)
        assert (await pool.job(job.id)).job.state == "succeeded"


async def test_a_lost_reexecution_goes_to_another_unrelated_agent(pool: Pool) -> None:
    job, _, others = await original_run(pool)
    v, lease = await reexecution(pool, others)
    ex = api.RankExit(job=job, rank=0, incarnation=lease.incarnation, code=-9, lost=True)
    r = await pool.post("/api/v1/agents/exit", ex, v.headers)
    assert r.status_code == 200
    t, lease3 = await reexecution(pool, [o for o in others if o is not v])
    await prints(pool, t, lease3, TRUE)
    # The lost one's late output and verdict change nothing.
    await prints(pool, v, lease, FORGED)
    await verdict(pool, lease, False)
    await replay(pool, t, lease3, TRUE)
    detail = await pool.job(job)
    assert detail.job.state == "succeeded" and detail.job.restarts == 1


async def test_trusted_agents_are_sampled_less(tmp_path: Path) -> None:
    async with open_pool(tmp_path, validation_trusted_after=2, validation_min_rate=0.0) as pool:
        await pool.register_relay("relay-0")
        a = await pool.enroll("agent-a", slots=1)
        pool.core.store.db.execute(  # type: ignore[attr-defined]
            "UPDATE agents SET agreed = 2000000000, agreed_streak = 2000000000 WHERE id = ?",
            [a.id],
        )
        job = await pool.submit(1, validate=True)
        [lease] = await pool.lease(a)
        await prints(pool, a, lease, TRUE)
        await pool.exit(a, lease)
        detail = await pool.job(job.id)
        # Sampled with probability 1e-9: not re-executed, and the job says so.
        assert detail.job.state == "succeeded"
        assert detail.ranks[0].validation == "skipped"
        assert "no rank sampled" in detail.job.validation


async def test_the_pool_policy_validates_every_job(tmp_path: Path) -> None:
    async with open_pool(tmp_path, validate_jobs=True) as pool:
        job = await pool.submit(1)
        assert job.validate
        bundle = await pool.upload(make_zip({"app.py": HELLO}))
        body = api.JobSubmit(ranks=1, bundle=bundle, entry="app.py", fault_tolerance=False)
        r = await pool.post("/api/v1/jobs", body, pool.user())
        assert r.status_code == 422 and "this pool validates every job" in r.text


async def test_validation_needs_fault_tolerance(pool: Pool) -> None:
    bundle = await pool.upload(make_zip({"app.py": HELLO}))
    body = api.JobSubmit(
        ranks=1, bundle=bundle, entry="app.py", fault_tolerance=False, validate=True
    )
    r = await pool.post("/api/v1/jobs", body, pool.user())
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_validate"


async def test_a_validated_jobs_images_keep_its_log_whole(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    a = await pool.enroll("agent-a", slots=1)
    job = await pool.submit(1, validate=True)
    [lease] = await pool.lease(a)
    await pool.heartbeat(a, [lease])
    report = api.RelayCheckpoint(
        name="relay-0", job=job.id, rank=0, incarnation=1, ckpt=5, size=10,
        digest="ab" * 32, fingerprint="fp", received={}, dets=0, meta=b"", retained=[5],
    )  # fmt: skip
    r = await pool.post("/api/v1/relays/checkpoint", report, relay_headers("relay-0"))
    assert decode(r, api.CheckpointAccepted) == api.CheckpointAccepted(trim=False)


async def test_a_relay_judges_only_jobs_it_serves(pool: Pool) -> None:
    job, _, others = await original_run(pool)
    _, lease = await reexecution(pool, others)
    await pool.register_relay("relay-1", port=7001)
    forged = api.RelayValidated(
        name="relay-1", job=job, rank=0, incarnation=lease.incarnation, agreed=False
    )
    r = await pool.post("/api/v1/relays/validated", forged, relay_headers("relay-1"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_your_job"
    assert (await pool.job(job)).job.state == "running"


# -- the rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("streak", "expected"), [(0, 1.0), (9, 1.0), (10, 1.0), (20, 0.5), (100, 0.1), (10**6, 0.1)]
)
def test_sampling_falls_with_the_record_of_agreeing(streak: int, expected: float) -> None:
    assert validation.chance(streak, Policy(trusted_after=10, min_rate=0.1)) == expected


def test_decisions() -> None:
    good, bad = Run(0, "aa"), Run(0, "bb")
    lied = Run(0, "aa", messages="relay r: seq 3 differs")
    assert validation.decide(good, good) is Verdict.AGREED
    assert validation.decide(good, bad) is Verdict.THIRD
    assert validation.decide(good, bad, good) is Verdict.VALIDATOR_WRONG
    assert validation.decide(bad, good, good) is Verdict.ORIGINAL_OUTPUT_WRONG
    assert validation.decide(good, lied, Run(-1, "", messages="x")) is (
        Verdict.ORIGINAL_MESSAGES_WRONG
    )
    assert validation.decide(good, Run(1, "aa"), Run(2, "aa")) is Verdict.UNDECIDED
    assert validation.differences(good, Run(3, "bb")) == "its exit code (3, not 0), its stdout"


def test_groups() -> None:
    assert validation.group("a1", 4) == validation.group("a2", 4) == "token 4"
    assert validation.group("a1", None) != validation.group("a2", None)


async def test_a_crashed_reexecution_is_no_evidence_against_the_messages(pool: Pool) -> None:
    """A re-execution that exits 1 sent fewer messages than the original (its relays say so):
    only its exit code counts, and a third execution clears the original."""
    job, a, others = await original_run(pool)
    v, lease = await reexecution(pool, others)
    await replay(pool, v, lease, b"Traceback ...\n", agreed=False, code=1)
    t, lease3 = await reexecution(pool, [o for o in others if o is not v])
    await replay(pool, t, lease3, TRUE)
    detail = await pool.job(job)
    assert detail.job.state == "succeeded", detail.job.reason
    assert trust(pool, v) == (0, 0, 1) and trust(pool, a) == (1, 1, 0)


async def test_a_reexecution_that_never_ends_is_replaced(pool: Pool) -> None:
    job, _, others = await original_run(pool)
    v, lease = await reexecution(pool, others)
    pool.clock.advance(299.0)
    await pool.heartbeat(v, [lease])
    await pool.relay_heartbeat("relay-0")
    await pool.core.check_timeouts()
    assert (await pool.job(job)).ranks[0].incarnation == lease.incarnation
    pool.clock.advance(2.0)
    await pool.heartbeat(v, [lease])
    await pool.heartbeat(others[1] if v is others[0] else others[0], [])
    await pool.relay_heartbeat("relay-0")
    await pool.core.check_timeouts()
    detail = await pool.job(job)
    assert any("did not finish within 300 s" in e.message for e in detail.events), "\n".join(
        f"{e.kind}: {e.message}" for e in detail.events
    )
    t, lease3 = await reexecution(pool, [o for o in others if o is not v])
    assert lease3.incarnation == lease.incarnation + 1
    await replay(pool, t, lease3, TRUE)
    assert (await pool.job(job)).job.state == "succeeded"


async def _running_on_a(pool: Pool) -> tuple[int, Agent, api.Lease]:
    """A validated job of one rank, running on agent-a."""
    await pool.register_relay("relay-0")
    a = await pool.enroll("agent-a", slots=1)
    job = await pool.submit(1, validate=True)
    [lease] = await pool.lease(a)
    await pool.heartbeat(a, [lease])
    return job.id, a, lease


async def _failed_on_a(pool: Pool, code: int) -> tuple[int, Agent, Agent, api.Lease]:
    """A validated job whose only rank agent-a reports exited with ``code``; agent-b idle."""
    job, a, lease = await _running_on_a(pool)
    b = await pool.enroll("agent-b", slots=1)
    r = await pool.exit(a, lease, code=code)
    assert r.status_code == 200, r.text
    return job, a, b, lease


async def test_a_failure_one_agent_reports_is_re_executed_and_a_false_one_distrusted(
    tmp_path: Path,
) -> None:
    """Issue 35: a rogue reporting exit 3 for an honest run failed a validated job at once.
    Now the rank is re-executed on another agent first; its clean exit proves the report
    false, and the reporter loses its validation streak."""
    async with open_pool(tmp_path) as pool:
        job, a, b, _ = await _failed_on_a(pool, 3)
        detail = await pool.job(job)
        assert detail.job.state == "running"
        challenged = [e.message for e in detail.events if e.kind == "rank_failure_challenged"]
        assert challenged == [
            "rank 0 exited with code 3 on agent agent-a: a validated job's failure is "
            "re-executed on another agent before the job fails"
        ]
        assert await pool.lease(a) == []  # not on the agent that reported it
        [again] = await pool.lease(b)
        assert (again.rank, again.incarnation) == (0, 2)
        await pool.heartbeat(b, [again])
        assert (await pool.exit(b, again, code=0)).status_code == 200
        detail = await pool.job(job)
        assert detail.job.state != "failed", detail.job
        wrong = [e.message for e in detail.events if e.kind == "validation_wrong"]
        assert wrong == [
            "rank 0: agent agent-a reported exit code 3, its re-execution on agent agent-b "
            "exited 0: agent agent-a was wrong"
        ]
        row = pool.core.store._one("SELECT wrong, agreed_streak FROM agents WHERE id = ?", [a.id])
        assert row is not None and (row["wrong"], row["agreed_streak"]) == (1, 0)


async def test_a_failure_its_re_execution_confirms_fails_the_job(tmp_path: Path) -> None:
    async with open_pool(tmp_path) as pool:
        job, _, b, _ = await _failed_on_a(pool, 3)
        [again] = await pool.lease(b)
        await pool.heartbeat(b, [again])
        assert (await pool.exit(b, again, code=3)).status_code == 200
        detail = await pool.job(job)
        assert (detail.job.state, detail.job.exit_code) == ("failed", 3)
        assert detail.job.reason == (
            "rank 0 exited with code 3 (confirmed by its re-execution on agent agent-b)"
        )


def test_network_of_an_address() -> None:
    assert validation.network("203.0.113.77") == "203.0.113.0/24"
    assert validation.network("2001:db8:aa:1::5") == "2001:db8:aa::/48"
    assert validation.network("::ffff:203.0.113.9") == "203.0.113.0/24"
    assert validation.network("127.0.0.1") == validation.network("::1") == ""  # no signal
    assert validation.network("") == validation.network("not an address") == ""


async def test_two_colluders_among_ten_agents(tmp_path: Path) -> None:
    """Issue 35: two colluding volunteers with two join tokens got a forged result
    validated. A re-executor is never of the original's network (/24), whatever token
    admitted it, and is drawn at random among the agents unrelated to the original: over
    many draws, the colluder is never one, and the honest agents all are."""
    async with open_pool(tmp_path) as pool:
        await pool.register_relay("relay-0")
        colluder = await pool.enroll("agent-c1", slots=1)
        job = await pool.submit(1, validate=True)
        [lease] = await pool.lease(colluder)
        await pool.heartbeat(colluder, [lease])
        partner = await pool.enroll("agent-c2", slots=1)
        honest = [await pool.enroll(f"agent-h{i}", slots=1) for i in range(8)]
        addresses = [
            (colluder, "198.51.100.10"),
            (partner, "198.51.100.200"),  # the same /24, another join token
            *[(h, f"203.0.{113 + i}.7") for i, h in enumerate(honest)],
        ]

        def called_from() -> None:
            """Where each agent calls from (a real coordinator takes it from each request;
            this test's all come from 127.0.0.1)."""
            for agent, address in addresses:
                pool.core.store.db.execute(
                    "UPDATE agents SET address = ? WHERE id = ?", [address, agent.id]
                )

        called_from()
        await prints(pool, colluder, lease, FORGED)
        assert (await pool.exit(colluder, lease)).status_code == 200
        assert await pool.lease(partner) == []  # never the colluder's partner
        v, _ = await reexecution(pool, honest)
        # Were another re-executor needed: any honest agent but the one drawn already.
        called_from()
        fit = {a.id: 1 for a in [colluder, partner, *honest]}
        unrelated = pool.core.store._unrelated(job.id, 0, 1, fit)
        assert set(unrelated) == {h.id for h in honest if h is not v}
        # The draw is random among the honest: over many, every one of them comes up.
        seen = {sqlite_faults._random.choice(sorted(unrelated)) for _ in range(400)}
        assert seen == set(unrelated)


async def test_an_agents_address_is_where_it_calls_from(tmp_path: Path) -> None:
    async with open_pool(tmp_path) as pool:
        agent = await pool.enroll("agent-a", slots=1)
        app = create_app(pool.core.settings, coordinator=pool.core)
        transport = httpx.ASGITransport(app=app, client=("203.0.113.5", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
            hb = api.AgentHeartbeat(ranks=[], free_slots=1)
            body = msgspec.json.encode(hb)
            r = await c.post("/api/v1/agents/heartbeat", content=body, headers=agent.headers)
            assert r.status_code == 200, r.text
        row = pool.core.store._one("SELECT address FROM agents WHERE id = ?", [agent.id])
        assert row is not None and row["address"] == "203.0.113.5"
        assert validation.network(row["address"]) == "203.0.113.0/24"


async def _results(pool: Pool, agent: Agent, lease: api.Lease, files: dict[str, bytes]) -> None:
    url = f"/api/v1/agents/results/{lease.job}/{lease.rank}/{lease.incarnation}"
    r = await pool.client.put(url, content=make_zip(files), headers=agent.headers)
    assert r.status_code == 200, r.text


async def _job_files(pool: Pool, job: int) -> dict[str, bytes]:
    r = await pool.client.get(f"/api/v1/jobs/{job}/results", headers=pool.user())
    assert r.status_code == 200, r.text
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        return {n: zf.read(n) for n in zf.namelist() if n.startswith("rank-0/")}


async def test_forged_result_files_are_caught_and_replaced(tmp_path: Path) -> None:
    """Issue 35: forged result files were delivered from a job marked "re-executed and
    confirmed". A run's files are compared by digest (name and content of each): a
    re-execution whose files differ disagrees, and the agreed run's files become the rank's."""
    async with open_pool(tmp_path) as pool:
        job, a, lease = await _running_on_a(pool)
        others = [await pool.enroll(f"agent-{c}", slots=1) for c in "bc"]
        await prints(pool, a, lease, TRUE)
        await _results(pool, a, lease, {"result.txt": b"forged 42"})
        assert (await pool.exit(a, lease)).status_code == 200
        honest = {"result.txt": b"true 12"}
        v, lease2 = await reexecution(pool, others)
        await _results(pool, v, lease2, honest)
        await replay(pool, v, lease2, TRUE)
        t, lease3 = await reexecution(pool, [o for o in others if o is not v])
        await _results(pool, t, lease3, honest)
        await replay(pool, t, lease3, TRUE)
        detail = await pool.job(job)
        assert detail.job.state == "succeeded", detail
        corrected = [e.message for e in detail.events if e.kind == "validation_corrected"]
        assert corrected and "result files" in " ".join(
            e.message for e in detail.events if e.kind.startswith("validation")
        ), detail.events
        assert await _job_files(pool, job) == {"rank-0/result.txt": b"true 12"}


async def test_the_same_result_files_agree_whatever_their_zips(tmp_path: Path) -> None:
    """Two runs' files are the same when their names and contents are: the zips' own bytes
    (timestamps, compression) differ between machines."""
    async with open_pool(tmp_path) as pool:
        job, a, lease = await _running_on_a(pool)
        b = await pool.enroll("agent-b", slots=1)
        await prints(pool, a, lease, TRUE)
        await _results(pool, a, lease, {"out/result.txt": b"true 12", "log.txt": b"ok"})
        assert (await pool.exit(a, lease)).status_code == 200
        v, lease2 = await reexecution(pool, [b])
        other = io.BytesIO()
        with zipfile.ZipFile(other, "w", zipfile.ZIP_STORED) as zf:
            for name, data in (("log.txt", b"ok"), ("out/result.txt", b"true 12")):
                zf.writestr(zipfile.ZipInfo(name, date_time=(2001, 2, 3, 4, 5, 6)), data)
        url = f"/api/v1/agents/results/{job}/0/{lease2.incarnation}"
        r = await pool.client.put(url, content=other.getvalue(), headers=v.headers)
        assert r.status_code == 200, r.text
        await replay(pool, v, lease2, TRUE)
        detail = await pool.job(job)
        assert detail.job.state == "succeeded", detail.events
        assert not [e for e in detail.events if e.kind == "validation_corrected"]
        files = await _job_files(pool, job)
        assert files == {"rank-0/out/result.txt": b"true 12", "rank-0/log.txt": b"ok"}


async def stderr_of(pool: Pool, job: int) -> bytes:
    r = await pool.client.get(f"/api/v1/jobs/{job}/output?after=0", headers=pool.user())
    page = decode(r, api.OutputPage)
    return b"".join(rec.data for rec in page.records if rec.stream == "stderr")


async def test_forged_stderr_is_caught_and_replaced(tmp_path: Path) -> None:
    """Issue 35: a forged stderr was delivered from a job marked "re-executed and confirmed".
    Stderr is compared too (its paths normalised): the forgery is outvoted, and the rank's
    output becomes the agreed run's, both streams."""
    async with open_pool(tmp_path) as pool:
        job, a, lease = await _running_on_a(pool)
        others = [await pool.enroll(f"agent-{c}", slots=1) for c in "bc"]
        await pool.output(a, lease, "stdout", 0, TRUE)
        forged = b"WARNING: results unreliable, rerun with --unsafe\n"
        await pool.output(a, lease, "stderr", 0, forged)
        assert (await pool.exit(a, lease)).status_code == 200
        v, lease2 = await reexecution(pool, others)
        await replay(pool, v, lease2, TRUE)
        detail = await pool.job(job)
        assert any(
            e.kind == "validation_mismatch" and "its stderr" in e.message for e in detail.events
        ), detail.events
        t, lease3 = await reexecution(pool, [o for o in others if o is not v])
        await replay(pool, t, lease3, TRUE)
        detail = await pool.job(job)
        assert detail.job.state == "succeeded", detail.job.reason
        assert detail.ranks[0].validation == "corrected"
        assert await stdout_of(pool, job) == TRUE
        assert await stderr_of(pool, job) == warning(lease2)
        assert trust(pool, a) == (0, 0, 1)


def test_stderr_paths_name_the_sandbox_not_the_machine() -> None:
    paths = validation.StderrPaths("0f3a", 2)
    ranks = "/home/bob/.local/share/vpool/ranks"
    line = (
        f'  File "{ranks}/0f3a-2-7-x_1y2z3w/work/app.py", line 3\n'
        f"x={ranks}/0f3a-2-12-abcdefgh/home/out.txt /srv/envs/00ff/site/np/core.py\n"
    ).encode()
    assert paths.line(line) == (
        b'  File "/vpool/rank/work/app.py", line 3\n'
        b"x=/vpool/rank/home/out.txt /vpool/env/np/core.py\n"
    )
    # Another rank's or another job's directory, or any other path, is left as it is: a
    # difference there is a difference.
    for other in (f"{ranks}/0f3a-3-1-abc/work/a.py", f"{ranks}/0f3b-2-1-abc/a.py", "/etc/passwd"):
        assert paths.line(other.encode()) == other.encode()
    # The digest is over lines, whatever the chunks (a path split between two chunks).
    whole = line * 3
    chunks = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    assert paths.digest(chunks) == paths.digest([whole]) == paths.digest([paths.line(whole)])
    assert paths.digest([b"/vpool/rank/work/app.py\n"]) != paths.digest([b"/tmp/app.py\n"])


def test_stderr_paths_stay_linear_on_hostile_text() -> None:
    """The program writes its stderr: a line of 200,000 path components and no match, or a
    match after each, is normalised in one pass (a backtracking pattern took minutes)."""
    paths = validation.StderrPaths("0f3a", 2)
    many = b"/a" * 200_000 + b"/0f3a-2-"
    assert paths.line(many) == many
    hits = b"/r/0f3a-2-1-x/" * 50_000
    assert paths.line(hits) == b"/vpool/rank/" * 50_000
    # A line with no newline is normalised in bounded pieces.
    endless = [b"/b" * 65_536] * 40
    assert len(paths.digest(endless)) == 64
