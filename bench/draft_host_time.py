"""Host time of a draft head's step (``DraftRunner.propose``) on the CPU, before and
after a change: the draft runner of git revision ``--rev`` against the working tree's,
on the tiny random Llama with a random EAGLE / EAGLE-3 head (``lmkit.testing``).

One process builds two engines per mode, one with each draft runner, and runs the same
greedy requests on them alternately (``--rounds`` times, the first side alternating),
timing every ``propose`` call. Modes: ``eager`` (the CPU's default: no graph runners)
and ``padded`` (the target's verification steps and the head's passes through the
graph runners' padded, fixed-buffer path with ``use_graphs=False``: the code path CUDA
graphs take, run eagerly). On the CPU everything is synchronous: this measures Python
and operator overhead plus the tiny model's compute, not GPU time. In padded mode a
second table leaves out the time inside the graph runners' model calls (what a CUDA
graph replays in one launch): the host work a GPU step would still do around them::

    OMP_NUM_THREADS=1 python bench/draft_host_time.py --rev 20b895b --rounds 5

With ``--device cuda`` (triton attention) the modes are ``eager`` (``enforce_eager``)
and ``graphs`` (captured CUDA graphs, the target's and the head's); each ``propose``
then ends with the drafts' copy to the host, so its wall time is the draft step's
whole cost, GPU time included.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = ["abcabcabcabc", "the cat sat on the mat; the cat", "x", "0123401234",
           "abcabcabcabc"]


def old_draft_runner(rev: str, tmp: Path) -> Any:
    """The ``DraftRunner`` class of revision ``rev`` (its draft_graphs, staging and
    cuda_graphs modules beside it: the head's graph runners and staging of that
    revision; the target's graph runner is the working tree's on both sides)."""
    root = Path(__file__).resolve().parents[1]

    def load(name: str, path: str, *replace: tuple[str, str]) -> Any:
        if Path(rev).is_dir():  # a copy of the revision's files (no git history at hand)
            text = (Path(rev) / path).read_text()
        else:
            text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True,
                                  capture_output=True, text=True).stdout
        for old, new in replace:
            text = text.replace(old, new)
        file = tmp / f"{name}.py"
        file.write_text(text)
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    load("old_cuda_graphs", "core/lmkit/worker/cuda_graphs.py")
    load("old_staging", "core/lmkit/worker/staging.py")
    load("old_draft_graphs", "core/lmkit/worker/draft_graphs.py",
         ("from lmkit.worker.cuda_graphs import", "from old_cuda_graphs import"))
    return load("old_draft_runner", "core/lmkit/worker/draft_runner.py",
                ("from lmkit.worker.draft_graphs import", "from old_draft_graphs import"),
                ("from lmkit.worker.staging import", "from old_staging import")
                ).DraftRunner


def padded_capture() -> Any:
    """``maybe_capture`` for the CPU: graph runners with ``use_graphs=False``."""
    from lmkit.worker.cuda_graphs import CudaGraphRunner

    def capture(config, stack, model, kv_caches, device, max_model_len, aux_layers=()):
        return CudaGraphRunner(model, kv_caches, device, config.scheduler.max_num_seqs,
                               max_model_len, config.cache.block_size, use_graphs=False,
                               max_query_len=1 + config.speculative.num_speculative_tokens,
                               aux_layers=aux_layers)
    return capture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="20b895b",
                        help="the 'before' git revision (or a directory holding its files)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--proposers", nargs="+", default=["eagle", "eagle3"])
    parser.add_argument("--modes", nargs="+", default=None,
                        help="eager, padded (CPU) / eager, graphs (cuda)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    cuda = args.device == "cuda"
    modes = args.modes or (["eager", "graphs"] if cuda else ["eager", "padded"])

    import lmkit.worker.model_runner as model_runner
    import torch
    from lmkit import LLM, SamplingParams
    from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head
    from lmkit.testing.tiny_model import make_tiny_model
    from lmkit.worker.draft_runner import DraftRunner
    from lmkit_plugins.attention.torch_ref import TorchAttention

    torch.set_num_threads(1)
    plan = TorchAttention.plan

    def plan_scratch_padding(self, metadata):  # padding rows' writes to the null block
        plan(self, metadata)
        self._plan.slot_mapping = self._plan.slot_mapping.clamp(min=0)

    TorchAttention.plan = plan_scratch_padding
    tmp = Path(tempfile.mkdtemp(prefix="draft-host-time-"))
    runners = {"before": old_draft_runner(args.rev, tmp), "after": DraftRunner}
    times: dict[str, list[float]] = {}
    outside: dict[str, list[float]] = {}  # the same, less the graph bodies' time
    in_graph = [0.0]

    def timed(label: str, propose: Any) -> Any:
        def wrapper(self, *a):
            in_graph[0] = 0.0
            start = time.perf_counter()
            out = propose(self, *a)
            elapsed = time.perf_counter() - start
            times[label].append(elapsed)
            outside[label].append(elapsed - in_graph[0])
            return out
        return wrapper

    def graph_body(run_model: Any) -> Any:
        def wrapper(self, bs):
            start = time.perf_counter()
            out = run_model(self, bs)
            in_graph[0] += time.perf_counter() - start
            return out
        return wrapper

    for label, cls in runners.items():
        cls.propose = timed(label, cls.propose)
    from lmkit.worker.cuda_graphs import CudaGraphRunner
    for graph_cls in (CudaGraphRunner, sys.modules["old_cuda_graphs"].CudaGraphRunner):
        graph_cls._run_model = graph_body(graph_cls._run_model)
    # head size 64 on CUDA: the smallest the triton backend serves
    tiny = (make_tiny_model(tmp / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2)
            if args.device == "cuda" else make_tiny_model(tmp / "tiny"))
    heads = {"eagle": make_tiny_eagle_head(tmp / "eagle", tiny, layer_std=0.3),
             "eagle3": make_tiny_eagle3_head(tmp / "eagle3", tiny)}
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    capture = model_runner.maybe_capture
    print(f"{'proposer':8} {'mode':6} {'batch':>5} {'before us/step':>16} "
          f"{'after us/step':>15} {'after/before':>12}")
    for proposer in args.proposers:
        for mode in modes:
            model_runner.maybe_capture = padded_capture() if mode == "padded" else capture
            device = ({"device": "cuda", "attention": "triton", "block_size": 16,
                       "enforce_eager": mode == "eager"} if cuda
                      else {"device": "cpu", "block_size": 4})
            for batch in args.batches:
                engines, tokens = {}, {}
                for label, cls in runners.items():
                    model_runner.DraftRunner = cls
                    engines[label] = LLM(str(tiny), speculative=proposer,
                                         speculative_model=str(heads[proposer]),
                                         num_speculative_tokens=3, num_blocks=128,
                                         max_num_seqs=batch, dtype="float32",
                                         max_model_len=64, **device)
                model_runner.DraftRunner = DraftRunner
                medians: dict[str, list[float]] = {label: [] for label in runners}
                outer: dict[str, list[float]] = {label: [] for label in runners}
                for r in range(args.rounds + 1):  # round 0 warms up
                    order = list(runners) if r % 2 else list(reversed(runners))
                    for label in order:
                        times[label], outside[label] = [], []
                        outs = engines[label].generate(PROMPTS, greedy)
                        tokens[label] = [o.outputs[0].token_ids for o in outs]
                        if r:
                            medians[label].append(statistics.median(times[label]) * 1e6)
                            outer[label].append(statistics.median(outside[label]) * 1e6)
                assert tokens["before"] == tokens["after"], "outputs differ"
                for llm in engines.values():
                    llm.shutdown()
                rows = [(mode, medians)] + ([("host", outer)] if mode == "padded" else [])
                for name, table in rows:  # host: padded, less the graph bodies
                    b, a = (statistics.median(table[k]) for k in ("before", "after"))
                    spread = {k: f"{min(v):.0f}-{max(v):.0f}" for k, v in table.items()}
                    print(f"{proposer:8} {name:6} {batch:5d} {b:8.0f} ({spread['before']:>9}) "
                          f"{a:7.0f} ({spread['after']:>9}) {a / b:10.2f}", flush=True)


if __name__ == "__main__":
    main()
