"""Upper bounds of the numbers a run trains with, checked where a value enters (a YAML, an override,
``submit``, a request file). Each is far above any real setting and low enough that the arithmetic downstream
holds it: step, sample and token counts and their products stay within int64 and convert to float, learning
rates and Adam's constants stay within fp32 (a value over ~3.4e38 cannot even be handed to an fp32 kernel), a
rank or a count of ranks within what a shape can hold. A value outside is one error naming its field, before
anything runs."""

from __future__ import annotations

from lorafusion.core.lora import MAX_ALPHA, MAX_RANK  # noqa: F401 (lora.r, lora.lora_alpha: the LoRA schema's)

MAX_STEPS = 10**9  # optimizer steps (max_steps, warmup_steps, save_every, eval_every, log_every)
MAX_EPOCHS = 10**6
MAX_BATCH = 1 << 20  # samples an optimizer step (global_batch_size)
MAX_SEQ_LEN = 1 << 24  # tokens a sample (= MAX_TOKEN_CAPACITY: every sample fits one microbatch)
MAX_COUNT = 10**6  # small counts: patience, non-finite steps, checkpoints kept, lookahead
MAX_PRIORITY = 10**9
MAX_LR = 10.0  # optimizer.lr (a typical LoRA lr is 1e-5 .. 1e-2)
MAX_WEIGHT_DECAY = 10.0
MAX_EPS = 1.0
MAX_GRAD_NORM = 1e9
MAX_PARALLEL = 1 << 16  # tp, pp, dp, virtual stages, layers a stage
MAX_SECONDS = 1e7  # time limits and intervals (seconds; minutes fields: MAX_SECONDS / 60)
# a job's token budget, max_steps x global_batch_size x max_seq_len: tokens counted in int64
MAX_JOB_TOKENS = 1 << 62
