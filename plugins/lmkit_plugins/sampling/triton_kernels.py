"""The ``triton`` sampling kernels: the Triton sampling and rejection kernels of
:mod:`lmkit_kernels` where they measured faster (:mod:`lmkit_plugins.sampling.policy`),
the core's torch path everywhere else.

They serve exactly, and so only take, steps whose random rows have no per-request seed
(a seeded request draws from its own generator, which the kernels' noise cannot
reproduce) and, for ``sample``, no min-p (the kernel has no min-p filter); for
``verify``, deterministic drafts only (no draft distributions). Greedy rows go through
the kernels as greedy (temperature 0: a cheap argmax) and the sampler replaces them
with :meth:`TritonSamplingKernels.argmax`: lmkit's chunked argmax kernel for a few rows
of a large vocabulary (on CUDA), ``torch.argmax`` otherwise (the same result). The logits reach them already adjusted (bias, bans,
penalties, logits processors, grammar bitmask) and logprobs stay the sampler's.

A speculative device step's bookkeeping (``plan_device_step``, ``finish_device_step``)
runs as two kernels of :mod:`lmkit_kernels.spec_step` on CUDA instead of some thirty
torch ops (the same integers; ``LMKIT_SPEC_STEP_KERNELS=0`` keeps the torch ops).

The penalties (``apply_penalties``) run as one pass of :mod:`lmkit_kernels.penalties`
on CUDA (and in Triton's CPU interpreter, for the tests) instead of the torch path's
dozen passes over the penalised rows (the same logits bit for bit;
``LMKIT_PENALTY_KERNEL=0`` keeps the torch path).

Top-p rows are drawn by checking the race's winner against the nucleus
(:mod:`lmkit_kernels.sampling_race`; the same tokens as the threshold search, in about a
third of its passes) where that measured faster (large batches,
:func:`~lmkit_plugins.sampling.policy.uses_top_p_race`); ``LMKIT_TOP_P_RACE=0`` runs the
search for every row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from lmkit.api import DraftRows, PenaltyRows, RandomRows, TorchSamplingKernels
from lmkit_kernels.argmax import argmax_rows
from lmkit_kernels.checks import is_interpreting
from lmkit_kernels.pdl import switch_on
from lmkit_kernels.penalties import apply_penalties as triton_penalties
from lmkit_kernels.rejection_sample import rejection_sample
from lmkit_kernels.sampling import sample as triton_sample
from lmkit_kernels.spec_step import finish_step, plan_step

from lmkit_plugins.sampling.policy import (
    modes,
    use_kernel,
    uses_argmax_kernel,
    uses_top_p_race,
)

#: ``0`` keeps the torch ops for a speculative device step's bookkeeping
SPEC_STEP_KERNELS_ENV = "LMKIT_SPEC_STEP_KERNELS"


def spec_step_kernels(device_type: str) -> bool:
    """Whether a speculative device step's bookkeeping runs :mod:`lmkit_kernels.spec_step`'s
    two kernels (CUDA, unless ``LMKIT_SPEC_STEP_KERNELS=0``) instead of torch ops."""
    return device_type == "cuda" and switch_on(SPEC_STEP_KERNELS_ENV)


#: ``0`` keeps the torch path for the penalties
PENALTY_KERNEL_ENV = "LMKIT_PENALTY_KERNEL"


def penalty_kernel(device_type: str) -> bool:
    """Whether the penalties run :mod:`lmkit_kernels.penalties`' kernel: on CUDA, or on
    the CPU in Triton's interpreter (tests), unless ``LMKIT_PENALTY_KERNEL=0``."""
    return (device_type == "cuda" or is_interpreting()) and switch_on(PENALTY_KERNEL_ENV)


#: ``0`` draws top-p rows with the threshold search alone, not the race's checked winner
TOP_P_RACE_ENV = "LMKIT_TOP_P_RACE"


def top_p_race_rounds(num_rows: int, vocab: int) -> int | None:
    """The sampling kernel's ``race_rounds``: its default (``None``) where the race
    measured faster (:func:`~lmkit_plugins.sampling.policy.uses_top_p_race`), else ``0``
    (the search for every top-p row), and always ``0`` with ``LMKIT_TOP_P_RACE=0``."""
    return None if switch_on(TOP_P_RACE_ENV) and uses_top_p_race(num_rows, vocab) else 0


def _race_rows(vocab_size: int, max_rows: int) -> int | None:
    """The fewest rows (up to ``max_rows``) for which the sampling kernel takes the top-p
    race; ``None`` when no batch size does."""
    return next((n for n in range(1, max_rows + 1) if uses_top_p_race(n, vocab_size)), None)


def _modes(rows: RandomRows) -> tuple[str, ...]:
    return modes(rows.top_k is not None, rows.top_p is not None)


class TritonSamplingKernels(TorchSamplingKernels):
    """Triton where measured faster, torch elsewhere (see the module docstring)."""

    def sample(self, logits: torch.Tensor, rows: RandomRows) -> torch.Tensor:
        """See :meth:`lmkit.api.SamplingKernels.sample`."""
        num_rows, vocab = logits.shape
        if (rows.generators or rows.min_p is not None
                or not use_kernel("sample", _modes(rows), num_rows, vocab)):
            return super().sample(logits, rows)
        temperature = rows.temperature
        if temperature is None:
            temperature = torch.ones(num_rows, dtype=torch.float32, device=logits.device)
        if not rows.all_random:  # greedy rows: the kernel's cheap argmax (replaced later)
            temperature = temperature.masked_fill(rows.is_greedy, 0.0)
        return triton_sample(logits, temperature=temperature, top_k=rows.top_k,
                             top_p=rows.top_p, race_rounds=top_p_race_rounds(num_rows, vocab))

    def warm_up(self, vocab_size: int, max_rows: int) -> None:
        """See :meth:`lmkit.api.SamplingKernels.warm_up`: every filter set (temperature
        alone, top-k, top-p, both) the policy sends to the sampling kernel, at one row
        and at the fewest rows that take the top-p race (its launches and the search's
        variants that skip the rows it settled); the penalties with and without drafts;
        the argmax kernel. Without it a W1 run with sampling compiled 11 variants in
        its first steps (0.2 s stalls, session 31). On CUDA, or in Triton's interpreter
        (tests)."""
        device = torch.device(self.device)
        if device.type != "cuda" and not is_interpreting():
            return
        race_rows = _race_rows(vocab_size, max_rows)
        for n in (1,) if race_rows in (None, 1) else (1, race_rows):
            logits = torch.zeros(n, vocab_size, device=device)
            temperature = torch.ones(n, device=device)
            top_k = torch.full((n,), 50, dtype=torch.int64, device=device)
            top_p = torch.full((n,), 0.9, device=device)
            for k, p in ((None, None), (top_k, None), (None, top_p), (top_k, top_p)):
                if use_kernel("sample", modes(k is not None, p is not None), n, vocab_size):
                    triton_sample(logits, temperature=temperature, top_k=k, top_p=p,
                                  race_rounds=top_p_race_rounds(n, vocab_size))
        if penalty_kernel(device.type):
            n = 4
            rows = torch.arange(n, device=device)
            counts = torch.zeros(n, vocab_size, dtype=torch.int32, device=device)
            seen = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
            params = [torch.full((n,), v, device=device) for v in (1.1, 0.1, 0.1)]
            for drafts in (None, counts.clone()):
                triton_penalties(torch.zeros(n, vocab_size, device=device), rows, rows,
                                 counts, seen, *params, drafts)
        if uses_argmax_kernel(1, vocab_size, device.type):
            argmax_rows(torch.zeros(1, vocab_size, device=device))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """See :meth:`lmkit.api.SamplingKernels.argmax`: the chunked kernel where
        :func:`~lmkit_plugins.sampling.policy.uses_argmax_kernel` says so."""
        if (logits.dim() == 2 and logits.stride(-1) == 1
                and uses_argmax_kernel(logits.shape[0], logits.shape[1], logits.device.type)):
            return argmax_rows(logits)
        return super().argmax(logits)

    def apply_penalties(self, logits: torch.Tensor, penalties: PenaltyRows) -> torch.Tensor:
        """See :meth:`lmkit.api.SamplingKernels.apply_penalties`: one kernel where
        :func:`penalty_kernel` says so."""
        if not penalty_kernel(logits.device.type):
            return super().apply_penalties(logits, penalties)
        p = penalties
        return triton_penalties(logits, p.rows, p.slots, p.counts, p.seen, p.repetition,
                                p.frequency, p.presence, p.draft_counts)

    def verify(self, probs: torch.Tensor, rows: RandomRows, drafts: DraftRows,
               draft_probs: Sequence[torch.Tensor | None] | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`lmkit.api.SamplingKernels.verify`."""
        num_reqs = len(drafts.num_drafts)
        if (rows.generators or (draft_probs is not None and any(p is not None
                                                                for p in draft_probs))
                or not use_kernel("verify", _modes(rows), num_reqs, probs.shape[1])):
            return super().verify(probs, rows, drafts, draft_probs)
        device = probs.device
        num_drafts = np.asarray(drafts.num_drafts, dtype=np.int64)
        max_drafts = int(num_drafts.max())
        per_req = num_drafts + 1
        starts = np.asarray(drafts.row_starts, dtype=np.int64)
        # each row's place in the kernel's [num_reqs, max_drafts + 1] output
        flat = (np.repeat(np.arange(num_reqs) * (max_drafts + 1) - starts, per_req)
                + np.arange(int(per_req.sum())))
        host = torch.from_numpy(np.concatenate([np.cumsum(num_drafts), starts, flat]))
        index = host.to(device, non_blocking=True)
        cu_num_drafts, row_starts, out_index = (index[:num_reqs], index[num_reqs:2 * num_reqs],
                                                index[2 * num_reqs:])
        is_greedy = None if rows.all_random else rows.is_greedy[row_starts]
        noise = torch.empty_like(probs).exponential_()
        uniform = torch.rand(drafts.token_ids.numel(), device=device)
        out, num_accepted = rejection_sample(probs, drafts.token_ids, cu_num_drafts, uniform,
                                             noise, max_drafts, is_greedy)
        # -1 marks positions the output does not reach: any valid id will do there
        row_tokens = out.flatten()[out_index].clamp_(min=0)
        accepted = drafts.pos < num_accepted[drafts.req]
        return row_tokens, accepted

    def plan_device_step(self, targets: torch.Tensor, inputs: torch.Tensor,
                         start: torch.Tensor, tables: torch.Tensor, block_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :meth:`lmkit.api.SamplingKernels.plan_device_step`: one kernel on CUDA."""
        if not spec_step_kernels(targets.device.type):
            return super().plan_device_step(targets, inputs, start, tables, block_size)
        return plan_step(targets, inputs, start, tables, block_size)

    def finish_device_step(self, targets: torch.Tensor, accepted: torch.Tensor,
                           last: torch.Tensor, first: torch.Tensor, rest: torch.Tensor | None,
                           tables: torch.Tensor, block_size: int, decided: torch.Tensor,
                           inputs: torch.Tensor, positions: torch.Tensor,
                           slots: torch.Tensor) -> None:
        """See :meth:`lmkit.api.SamplingKernels.finish_device_step`: one kernel on CUDA."""
        if not spec_step_kernels(targets.device.type):
            super().finish_device_step(targets, accepted, last, first, rest, tables,
                                       block_size, decided, inputs, positions, slots)
            return
        finish_step(targets, accepted, last, first, rest, tables, block_size, decided,
                    inputs, positions, slots)
