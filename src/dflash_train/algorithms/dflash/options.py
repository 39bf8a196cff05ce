"""What DFlash declares without torch (the config loader imports this module through the registry,
`architectures.options`): no config section of its own; it implements a reduced draft vocabulary
(`drafter.draft_vocab_size`)."""

from __future__ import annotations

from ...architectures import Options

OPTIONS = Options(draft_vocabulary=True)
