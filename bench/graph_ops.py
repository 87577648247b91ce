"""The torch ops each captured CUDA graph of an engine runs, and the code line that issued
them: the graphs' kernel launches that do not come from lmkit's own Triton kernels
(copies, index arithmetic, argmax, ...), which a profile lists only by kernel name.

The engine is built as usual; while its graph runners capture the sizes asked for, a
dispatch mode counts every torch op that reaches a kernel (views and allocations
left out) by op name and the first frame in lmkit's code that called it::

    python bench/graph_ops.py --model smol.gguf --speculative-model HEAD --sizes 1 4
    python bench/graph_ops.py --sizes 1        # the random SmolLM2-shaped pair, plain too

Prints, per runner (the target's decode graphs, the head's catch-up and draft passes)
and size, the ops in the graph and the sites issuing them. Triton kernels launched by
lmkit are not torch ops and are not listed (``bench/spec_timeline.py`` counts every
kernel). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

#: ops that launch no kernel (views, metadata, allocation)
NO_KERNEL = {
    "view", "_unsafe_view", "slice", "select", "expand", "as_strided", "reshape", "t",
    "transpose", "permute", "unsqueeze", "squeeze", "detach", "alias", "split", "unbind",
    "narrow", "empty", "empty_strided", "empty_like", "lift_fresh", "_reshape_alias",
    "split_with_sizes", "view_as", "_to_copy_view", "clone_view", "unflatten", "flatten",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
}
_OWN = ("/lmkit/", "/lmkit_plugins/", "/lmkit_kernels/")


def call_site() -> str:
    """``file:line function`` of the innermost frame in lmkit's code (outside this file)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if any(p in name for p in _OWN):
            short = name.split("/lmkit")[-1].lstrip("_/")
            return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def install(sizes: set[int]) -> dict[str, dict[str, Any]]:
    """Patch the graph runner so that captures of ``sizes`` are logged; the log."""
    import torch
    from lmkit.worker import cuda_graphs
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[tuple[str, str]] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            name = func.overloadpacket.__name__
            if name.rstrip("_") not in NO_KERNEL:
                self.ops[(name, call_site())] += 1
            return func(*args, **(kwargs or {}))

    log: dict[str, dict[str, Any]] = {}
    original = cuda_graphs.CudaGraphRunner._run_model

    def run_model(self: Any, bs: int) -> Any:
        if bs not in sizes or not torch.cuda.is_current_stream_capturing():
            return original(self, bs)
        mode = OpLog()
        with mode:
            out = original(self, bs)
        label = f"{type(self.model).__name__} (chain {self.chain}) bs={bs}"
        n = 2
        while label in log:
            label = f"{label.split(' #')[0]} #{n}"
            n += 1
        log[label] = {"ops": sum(mode.ops.values()),
                      "sites": [{"op": op, "site": site, "calls": c}
                                for (op, site), c in mode.ops.most_common()]}
        return out

    cuda_graphs.CudaGraphRunner._run_model = run_model
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target (default: a random SmolLM2-shaped model)")
    ap.add_argument("--speculative-model", help="the EAGLE head (default: a random one)")
    ap.add_argument("--proposer", default="eagle3", help="'none' for plain decoding")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("graph_ops needs CUDA")
    from lmkit import LLM
    from spec_pair import pair_and_prompts

    model, head, _ = pair_and_prompts(args.model, args.speculative_model, 1)
    log = install(set(args.sizes))
    kwargs: dict[str, Any] = {}
    if args.proposer != "none":
        kwargs = {"speculative": args.proposer, "speculative_model": head,
                  "num_speculative_tokens": args.k}
    llm = LLM(model, device="cuda", attention=args.attention, dtype="bfloat16",
              max_num_seqs=args.max_num_seqs, max_model_len=2048,
              gpu_memory_utilization=0.3, **kwargs)
    llm.shutdown()
    for label, entry in log.items():
        print(f"\n== {label}: {entry['ops']} torch ops")
        for s in entry["sites"]:
            print(f"  {s['calls']:4d}  {s['op']:28s} {s['site']}")
    if args.out:
        args.out.write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
