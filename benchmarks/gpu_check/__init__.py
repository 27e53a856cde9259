"""The GPU check (issue 44): every GPU question the project owes, in one device call.

    bash scripts/gpu_check.sh            # the whole check (about 420 s on a CUDA card)
    bash scripts/gpu_check.sh --short    # steps 1-3 only: a rerun after a fix
    bash scripts/gpu_check.sh --cpu      # tiny shapes on the CPU (Triton's interpreter): CI's

Steps, most important first, each in its own process under its own `timeout` (`plan.STEPS`):
1 the environment (versions, card, the project imports with the machine's packages and no
vLLM); 2 the Triton kernels against their PyTorch references (the kernel tests, compiled) and
timed at Llama-3-8B shapes; 3 MoA's paged draft step without vLLM at Llama-3-8B drafter shapes
(Triton vs PyTorch pages, eager vs CUDA graph vs torch.compile) next to one target layer: the
draft / target cost ratio c; 4 the standalone engine's greedy output against plain decoding
and its sampling path; 5 a training step's tokens/s and peak memory; 6 the cost model's
projection, fed c. One results JSON, rewritten after every step (a cut-off call still returns
the steps that finished), and one log, both named after the card. See docs/gpu.md.
"""
