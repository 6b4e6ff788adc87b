"""A family that always starts with BOS (Gemma): the bundle's tokenizer adds it, as HF's tokenizer class does.

Gemma models degrade without their <bos>. transformers' GemmaTokenizerFast adds it whatever the checkpoint's
tokenizer.json says (add_bos_token defaults to true and rewrites the post-processor), so a tokenizer.json
whose post-processor does not add it gets one here, at build time: the runtime then encodes as HF does.
"""
from __future__ import annotations

from engc.bundle.model_config import ModelConfig
from engc.compiler.frontend.families import FAMILIES

TOKENIZER = "tokenizer/tokenizer.json"


def with_bos(files: dict[str, bytes], cfg: ModelConfig) -> dict[str, bytes]:
    """files (the bundle's tokenizer files) with a BOS-adding post-processor where cfg's family needs one."""
    family = FAMILIES.get(cfg.family)
    if family is None or not family.bos_always or cfg.bos_token_id is None or TOKENIZER not in files:
        return files
    from tokenizers import Tokenizer, processors
    tok = Tokenizer.from_str(files[TOKENIZER].decode())
    bos = tok.id_to_token(cfg.bos_token_id)
    if bos is None or tok.encode("a").ids[:1] == [cfg.bos_token_id]:
        return files
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                       special_tokens=[(bos, cfg.bos_token_id)])
    return {**files, TOKENIZER: tok.to_str().encode()}
