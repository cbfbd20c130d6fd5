"""The builders the tests share (tests/helpers) make what the other tests assume."""

from r2lm import R2LMForDiffusionLM
from tests.helpers.models import make_model_dir, tiny_tokenizer
from tests.helpers.training import corpus_paragraphs


def test_corpus_is_tokenised_into_known_words(tmp_path):
    tok = tiny_tokenizer()  # byte level (its 92-token budget is below the 256-byte alphabet): one id per character
    texts = corpus_paragraphs(3)
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    assert [len(x) for x in ids] == [len(t) for t in texts]
    assert tok.batch_decode(ids) == texts


def test_model_dir_loads(tmp_path):
    folder = make_model_dir(tmp_path / "m")
    model = R2LMForDiffusionLM.from_pretrained(folder)
    assert model.config.sidecar_layers == [1, 3] and model.config.eos_token_id == 0
    assert (folder / "tokenizer.json").is_file()
