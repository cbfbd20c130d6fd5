"""The benchmark's chat split (r2lm.workloads): no held-out prompt's text and no segment of a held-out conversation
reaches training (issue 40 item 5: the split hashed segment ids, and 50 held-out prompts stood word for word among
the training prompts)."""

import pytest

from r2lm.workloads import (
    conversation_of,
    is_heldout,
    is_heldout_prompt,
    normalised,
    sharegpt_prompts,
    split_conversations,
)


def conv(id_, text):
    return {"id": id_, "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "..."}]}


def test_segments_and_prompt_texts_fall_on_one_side():
    held = next(f"h{i}" for i in range(1000) if is_heldout(f"h{i}"))
    free = [f"t{i}" for i in range(1000) if not is_heldout(f"t{i}")]
    records = [conv(f"{held}_0", "What is X?"), conv(f"{held}_7", "And Y?"),  # one conversation, two segments
               conv(f"{free[0]}_0", "  what   is x? "),  # another conversation asking the held-out text
               conv(f"{free[1]}_0", "And Z?"), conv(f"{free[1]}_3", "and y?"),  # linked through "And Y?"
               conv(f"{free[2]}_0", "Unrelated")]
    assert split_conversations(records) == {held, free[0], free[1]}
    assert conversation_of(f"{held}_12") == held and conversation_of("no_suffix") == "no_suffix"
    assert conversation_of("_3") == "_3" and normalised(" A\n b ") == "a b"


@pytest.mark.slow
def test_no_heldout_prompt_text_or_conversation_reaches_training():
    """On the packaged ShareGPT file (a few seconds)."""
    train, heldout = sharegpt_prompts("train", max_chars=None), sharegpt_prompts("heldout", max_chars=None)
    assert len(heldout) > 100 and len(train) > 10 * len(heldout)
    texts = {normalised(p.text) for p in heldout}
    conversations = {conversation_of(p.id.partition("/")[2]) for p in heldout}
    assert not [p.id for p in train if normalised(p.text) in texts]
    assert not [p.id for p in train if conversation_of(p.id.partition("/")[2]) in conversations]
    assert all(is_heldout_prompt(p.id) for p in heldout) and not any(is_heldout_prompt(p.id) for p in train)
    segment = next(p.id for p in heldout if p.id.endswith("_0"))  # another segment of a held-out conversation
    assert is_heldout_prompt(segment[:-2] + "_99")
