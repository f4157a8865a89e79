"""Ollama's chat truncation rule (api/model_defaults.fit_chat), with one token per character as the encoder."""

from gpushare.api.model_defaults import fit_chat


def encode(messages):
    return list("".join(m["content"] for m in messages))


def chat(*pairs):
    return [{"role": role, "content": content} for role, content in pairs]


MESSAGES = chat(("system", "S"), ("user", "aaaa"), ("assistant", "bbbb"), ("system", "T"), ("user", "cccc"),
                ("assistant", "dd"), ("user", "ee"))


def test_a_chat_that_fits_is_untouched():
    assert fit_chat(encode, MESSAGES, 100) == encode(MESSAGES)


def test_the_oldest_go_first_and_system_messages_stay():
    # room 9: S T cccc dd ee is 10 tokens, too long; dropping cccc leaves S T dd ee (6)
    assert "".join(fit_chat(encode, MESSAGES, 9)) == "STddee"
    assert "".join(fit_chat(encode, MESSAGES, 11)) == "STccccddee"


def test_the_last_message_always_stays_and_truncate_false_keeps_everything():
    assert "".join(fit_chat(encode, MESSAGES, 2)) == "STee"  # still too long: the caller answers 400
    assert fit_chat(encode, MESSAGES, 2, truncate=False) == encode(MESSAGES)


def test_every_start_agrees_with_trying_each_in_turn():
    for room in range(1, 25):
        expected = None
        for start in range(1, len(MESSAGES)):
            kept = [m for m in MESSAGES[:start] if m["role"] == "system"] + MESSAGES[start:]
            if len(encode(kept)) < room:
                expected = encode(kept)
                break
        if len(encode(MESSAGES)) < room:
            expected = encode(MESSAGES)
        elif expected is None:
            expected = encode([m for m in MESSAGES[:-1] if m["role"] == "system"] + MESSAGES[-1:])
        assert fit_chat(encode, MESSAGES, room) == expected, room
