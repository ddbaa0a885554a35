"""probe: the numerical-parity probe each published version carries, computed on the trainer.

Per version (`version_probe`, collective: every rank calls it alike; rank 0's probe goes into the
manifest):

    prompts    the run's, chosen once (`choose_prompts`): `probe_prompts` prompts of
               `probe_tokens` distinct token ids each (weightsync.models.probe.draw_prompts). For
               MoE models, prompts are added from a drawn pool until every sparse layer's router
               has chosen every expert at some position (at most as many again), so that a
               swapped or misrouted expert shows; what no pool prompt reaches is logged.
    records    the prompts through the weights exactly as published (each tensor gathered whole,
               one at a time, cast as the publisher casts it) in each of `probe_dtypes`: what an
               engine computing in that dtype must reproduce (the alarm, agents/parity.py)
    training   the prompts through the training forward as it trains (`probe_top_k` next tokens
               per position): what the policy would sample, for the training/inference gap figure

Not here: the probe's manifest form (weightsync.format.probe), the staged forward and the prompt
draws (weightsync.models.probe), the engine's gathers (engine.py), comparing (agents/parity.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightsync.format.probe import MAX_PROBE_PROMPTS, Probe
from weightsync.models.probe import DEFAULT_PROMPT_SEED, check_prompts, cover_experts, draw_prompts, to_probe
from weightsync.trainer.config import PublishConfig

log = logging.getLogger(__name__)

POOL_FACTOR = 4
"""MoE coverage repair: candidates drawn, as a multiple of probe_prompts, in one extra pass."""


def version_probe(
    engine: Any,
    config: PublishConfig,
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    kind: str = "full",
) -> Probe | None:
    """The parity probe of the version about to be published (None when `probe_prompts` is 0), on
    `prompts` (None: the run's first version, which chooses them: `choose_prompts`; the caller
    keeps the probe's prompts for the next versions). Collective: every rank calls it alike."""
    if config.probe_prompts == 0:
        return None
    published = _published_dtype(config)
    dtypes = [getattr(torch, name) for name in config.probe_dtypes]
    if prompts is None:
        prompts = choose_prompts(engine, config, kind=kind)
    check_prompts(prompts, engine.config.vocab_size)
    runs = engine.probe(prompts, compute_dtypes=dtypes, published_dtype=published, kind=kind)
    training = engine.probe_training(prompts, config.probe_top_k) if config.probe_top_k else None
    return to_probe(
        prompts,
        {name: runs[dtype] for name, dtype in zip(config.probe_dtypes, dtypes, strict=True)},
        training=training,
        training_dtype=engine.compute_dtype,
    )


def choose_prompts(engine: Any, config: PublishConfig, *, kind: str = "full") -> list[list[int]]:
    """The run's probe prompts (module docstring): drawn, and for MoE models repaired until every
    sparse layer routes to every expert (or the pool is spent). Collective; every rank gets rank 0's."""
    model = engine.config
    draws = draw_prompts(model.vocab_size, length=config.probe_tokens, seed=DEFAULT_PROMPT_SEED)
    prompts = list(itertools.islice(draws, config.probe_prompts))
    if model.is_moe:
        room = min(config.probe_prompts, MAX_PROBE_PROMPTS - len(prompts))
        pool = prompts + list(itertools.islice(draws, POOL_FACTOR * config.probe_prompts))
        dtype = getattr(torch, config.probe_dtypes[0])
        run = engine.probe(pool, compute_dtypes=[dtype], published_dtype=_published_dtype(config), kind=kind)[dtype]
        chosen, missing = cover_experts(model, pool, run, keep=len(prompts), room=room)
        if len(chosen) > len(prompts):
            log.info(
                "parity probe: %d prompts added so that the routers choose every expert", len(chosen) - len(prompts)
            )
        if missing:
            log.warning(
                "parity probe: no prompt drawn makes some routers choose every expert (sparse layer: experts never "
                "chosen: %s); a fault in those experts would not show in the probe",
                missing,
            )
        prompts = chosen
    if dist.is_initialized():  # every rank computed the same; rank 0's is what the manifest holds
        box = [prompts]
        dist.broadcast_object_list(box, src=0)
        prompts = box[0]
    return prompts


def _published_dtype(config: PublishConfig) -> torch.dtype | None:
    cast = config.publisher.cast_floats_to
    return getattr(torch, cast) if cast else None
