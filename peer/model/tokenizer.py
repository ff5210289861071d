"""The bundled model's character-level tokenizer: 16 tokens, enough for ``abc+def=`` → ``wxyz<eos>``.

Built with ``tokenizers`` and wrapped as a ``PreTrainedTokenizerFast`` so everything downstream treats it like
any hub tokenizer. Encoding prepends ``<bos>``; decoding concatenates characters.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = tuple("0123456789+=")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=64,
    )
