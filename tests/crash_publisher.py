"""Publishes version after version of a ~6 MB model to a store (a directory or s3:// URI) until killed.

The child process of tests/test_crash.py, which SIGKILLs it at random points. Version v always
holds `state_for(v)`, so the test can recompute what every committed version must hold. It
continues from whatever the store holds (`parent_from_store`), so a restart after a kill writes
a delta on the last committed version.

    python tests/crash_publisher.py STORE_URI [MAX_VERSIONS] [REBASE_EVERY]

Prints "ready <first version>" when it starts publishing and "committed <v>" after each commit;
exits 0 after MAX_VERSIONS versions (default: effectively forever).
"""

from __future__ import annotations

import functools
import sys

import torch

MODEL = "crash/model"
CHUNK_BYTES = 64 * 1024  # ~100 chunk objects per full version
REBASE_EVERY = 4
PACK_BYTES = 32 * 1024  # small packs: a delta writes several, so kills land between pack writes too
SHAPES = {
    "embed.weight": (1024, 512),
    "layers.0.attn.weight": (512, 1024),
    "layers.0.mlp.weight": (1024, 1024),
    "layers.0.norm.weight": (1024,),
    "layers.1.attn.weight": (512, 1024),
    "layers.1.mlp.weight": (1024, 768),
}  # ~3.1M fp32 elements: ~6 MB published as bf16


@functools.lru_cache(maxsize=1)
def _base_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    sd = {name: torch.randn(shape, generator=g) * 0.05 for name, shape in SHAPES.items()}
    sd["position_ids"] = torch.arange(512, dtype=torch.int64)
    sd["logit_scale"] = torch.tensor(3.0)
    return sd


def state_for(version: int) -> dict[str, torch.Tensor]:
    """The fp32 weights version `version` publishes: the base with ~2% of elements nudged."""
    g = torch.Generator().manual_seed(version)
    out = {}
    for name, t in _base_state().items():
        if t.is_floating_point() and t.dim():
            mask = torch.rand(t.shape, generator=g) < 0.02
            t = torch.where(mask, t * (1.0 + 1e-3 * torch.randn(t.shape, generator=g)), t)
        out[name] = t
    return out


def main(root: str, max_versions: int, rebase_every: int = REBASE_EVERY) -> int:
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.stores import open_store
    from weightsync.versions import latest_version

    store = open_store(root)
    config = PublisherConfig(
        chunk_bytes=CHUNK_BYTES,
        workers=2,
        max_in_flight=2,
        rebase_every=rebase_every,
        rebase_chain_ratio=1e9,
        pack_bytes=PACK_BYTES,
    )
    _base_state()
    first = (latest_version(store, MODEL) or 0) + 1
    pending = []
    with Publisher(store, model=MODEL, config=config) as publisher:
        print(f"ready {first}", flush=True)
        for version in range(first, first + max_versions):
            # Keep one version in flight while the next is snapshotted, as a trainer does.
            pending.append((version, publisher.publish(state_for(version), step=version)))
            while len(pending) > 1 or (pending and version == first + max_versions - 1):
                want, future = pending.pop(0)
                got = future.result().version
                if got != want:
                    print(f"published version {got}, expected {want}", file=sys.stderr, flush=True)
                    return 1
                print(f"committed {want}", flush=True)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[0], int(args[1]) if len(args) > 1 else 10**6, *(int(a) for a in args[2:3])))
