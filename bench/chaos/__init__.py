"""chaos: seeded rounds of faults against a real weightsync cluster, with invariants checked throughout.

    .venv/bin/python -m bench.chaos --rounds 100 --seed 1 [--store local|s3|both] [--swap-policy in_flight|mixed]

One machine: a publisher process (it can be SIGKILLed), a store (a local directory, or S3 served by
moto behind harness/fault_proxy.py), and 2 regions x 2 agent processes (`weightsync agent`, each with
the reference inference engine); the publisher pushes to one leader per region, leaders relay to
their follower. Every link between them runs through a TCP relay (harness/tcp_relay.py) that can flip
bytes in flight or black-hole the link (a partition). Manifests are signed and agents require
signatures and a token: the configuration a deployment on a shared network runs.

Each round publishes a few versions while a random mix of faults, drawn from the seed, hits:
SIGKILL of the publisher (mid-encode/upload) or of an agent (mid-stream, mid-relay, mid-swap: at a
random moment of a publish or right after its commit), SIGSTOP of an agent (a hang), a region
leader partitioned away, bytes flipped in flight (on any link) and at rest (a chunk object in the
store, a file in an agent's cache), S3 500s, SlowDowns, resets, truncated bodies, delays and lost
responses, an agent restarted from an older copy of its cache, clock skew in manifests (epoch, years
in the past or future), and garbage collection racing the publisher. Then the faults stop, and
every agent must converge on the store's latest version.

Invariants, checked continuously by a monitor thread and at the end of each round:
  served_digest      what an engine serves (GET /v1/version) is a committed version, with that
                     version's digest; the agent's own re-hash of the served bytes
                     (GetStatus verify) equals it; at each convergence the served model's greedy
                     completion equals the one computed here from the trainer's weights. Per token
                     step: long greedy generations run on every agent through the faults and
                     swaps, and each token range of their answers is what its version's published
                     weights generate from the prefix before it (one range per answer except
                     on an agent whose swap policy is in_flight;
                     `--swap-policy mixed` gives the four agents drain, in_flight, abort, in_flight).
  readable           every version in the store verifies (Reader.verify) at the end of each round,
                     and its digest equals that of the trainer's weights for its step.
  monotonic          within an agent process, the served version never goes backwards; a process
                     restarted on its own cache never serves older than before it died. (Restarts
                     from a deliberately stale cache copy serve that older version until they catch
                     up: counted and timed, not a violation; the agent cannot know its disk is old.)
  convergence        once the faults stop and every process is up, all agents serve the latest
                     version within --convergence-bound-s.
  memory             each process's RSS stays within its first served sample + a bound.
  no_hang            every publish finishes or fails within its deadline; every process starts.
Corrupting a *committed* object at rest makes that version unreadable by design (there is no second
copy): the invariant there is detection, not survival. Every version naming the object must fail
to verify (never return other bytes), agents must keep serving verified bytes, and once the object is
restored (what re-replication or a backup does) everything converges; it is restored before the
end-of-round checks.

Prints one JSON summary (config, machine, rounds, faults by kind, violations with details, convergence
p50/p90/max, peak RSS per kind of process) and exits 1 on any violation. tests/test_chaos.py runs a
few rounds in CI, through this command line.

Modules, in the order a run meets them: config (what a run is), publisher (the publisher process),
processes (starting, killing and reading the processes), monitor (invariants watched while faults
happen), faults (injecting them), checks (convergence and end-of-round checks), run (one cluster and
its rounds), __main__ (the command line). Not here: throughput or latency numbers (bench/transport.py,
bench/sync_latency.py).
"""
