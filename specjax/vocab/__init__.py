"""Vocabulary heads for the drafter: full, FR-Spec / PA-FR, DynaSpec (see :mod:`.head`)."""

from specjax.vocab.head import Candidates, FullHead, VocabHead, full_head
from specjax.vocab.resolve import resolve_head

__all__ = ["Candidates", "FullHead", "VocabHead", "full_head", "resolve_head"]
