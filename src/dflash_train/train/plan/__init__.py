"""The plan: everything a run decides before any weights load. The GPU and host memory a rank needs (`preflight`,
from the activation estimate of `activation_memory`), the extreme batches of the deterministic data plan that the
warm-up compiles (`size_classes`), how far the plan keeps the compiled graphs from 32-bit indexing (`indexing`), and
what FP8 training and an FP8 target need (`fp8_plan`). Nothing here loads a model or writes to the run directory."""
