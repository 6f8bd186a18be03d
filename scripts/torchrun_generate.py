"""Greedy generation with every rank started by torchrun (``external_launcher``, SPMD).

    torchrun --standalone --nproc-per-node 2 scripts/torchrun_generate.py MODEL \
        --prompt "The quick brown fox" --max-tokens 16 [--platform cpu] [--json-out DIR] \
        [--data-parallel-size 2 --enable-expert-parallel --all2all-backend alltoall]

Every rank runs this same program: the same engine over the same prompts, its shard of
the model, the same sampled tokens. Rank 0 prints; ``--json-out`` makes each rank write
its token ids (and its dummy lockstep forwards) to ``DIR/rank{RANK}.json`` (the tests
compare them).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--platform", default=None)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="DP ranks (each an engine over its share of the prompts); "
                             "tensor parallel size = WORLD_SIZE / this")
    parser.add_argument("--all2all-backend", default="allgather_reducescatter")
    parser.add_argument("--engine-args", default="{}",
                        help="more LLM keywords as a JSON object")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    from inference_engine import LLM, SamplingParams

    world = int(os.environ["WORLD_SIZE"])
    dp = args.data_parallel_size
    llm = LLM(args.model, platform=args.platform, tensor_parallel_size=world // dp,
              data_parallel_size=dp, enable_expert_parallel=args.enable_expert_parallel,
              all2all_backend=args.all2all_backend,
              distributed_executor_backend="external_launcher", show_progress=False,
              **json.loads(args.engine_args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if dp > 1:  # each DP rank runs its share; every rank gets every output
        from inference_engine.distributed.data_parallel import generate_data_parallel

        outputs = generate_data_parallel(llm, args.prompt, params)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    rank = int(os.environ["RANK"])
    if args.json_out:
        Path(args.json_out, f"rank{rank}.json").write_text(json.dumps({
            "token_ids": [o.outputs[0].token_ids for o in outputs],
            # Forwards this DP rank ran only to keep the MoE layers in lockstep.
            "dummy_forwards": getattr(llm.engine.runner, "dummy_forwards", 0)}))
    if rank == 0:
        for prompt, output in zip(args.prompt, outputs, strict=True):
            print(f"{prompt}{output.outputs[0].text}")
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
