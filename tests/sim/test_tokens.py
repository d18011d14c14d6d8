"""Unit tests of the simulator's tokenizer, chat template, deterministic output and embeddings."""

from gateway.sim import tokens


def test_encode_is_stable_and_near_four_chars_per_token():
    text = "The gateway routes each request to the engine that serves its shape best. " * 20
    ids = tokens.encode(text)
    assert ids == tokens.encode(text)
    assert 3.0 <= len(text) / len(ids) <= 5.0
    assert all(0 <= t < tokens.VOCAB for t in ids)


def test_special_markers_are_single_tokens():
    ids = tokens.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokens.SPECIAL_IDS[tokens.IM_START]
    assert ids[-1] == tokens.SPECIAL_IDS[tokens.IM_END]


def test_chat_template_renders_chatml_with_generation_prompt():
    text = tokens.render_chat([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
    ])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<image_url><|im_end|>\n<|im_start|>assistant\n")


def test_output_is_deterministic_per_seed_and_prompt():
    prompt = tokens.encode("tell me a story")
    a = tokens.generate(0, prompt, 50)
    assert a == tokens.generate(0, prompt, 50)
    assert a != tokens.generate(1, prompt, 50)
    assert a != tokens.generate(0, tokens.encode("another prompt"), 50)
    assert tokens.generate(0, prompt, 50, request_seed=7) != a


def test_output_length_limit_and_ignore_eos():
    prompt = [1, 2, 3]
    natural = tokens.generate(0, prompt, 10_000)
    assert natural.finish_reason == "stop" and 12 <= len(natural.pieces) <= 80
    capped = tokens.generate(0, prompt, 5)
    assert capped.finish_reason == "length" and len(capped.pieces) == 5
    forced = tokens.generate(0, prompt, 300, ignore_eos=True)
    assert forced.finish_reason == "length" and len(forced.pieces) == 300
    assert len(forced.ids) == len(forced.pieces)


def test_output_text_retokenizes_to_the_same_count():
    out = tokens.generate(3, [9, 9, 9], 64, ignore_eos=True)
    assert len(tokens.encode(out.text)) == len(out.pieces)


def test_stop_string_cuts_output_and_is_not_returned():
    full = tokens.generate(0, [5, 6], 40, ignore_eos=True)
    word = full.pieces[6].strip()
    cut = tokens.generate(0, [5, 6], 40, ignore_eos=True, stop=[word])
    assert cut.finish_reason == "stop" and cut.stop_string == word
    assert word not in cut.text
    assert full.text.startswith(cut.text)
    assert len(cut.pieces) <= 7


def test_embeddings_are_deterministic_unit_vectors():
    v = tokens.embed("hello")
    assert v == tokens.embed("hello") and v != tokens.embed("world")
    assert len(v) == 16
    assert abs(sum(x * x for x in v) - 1.0) < 1e-4
