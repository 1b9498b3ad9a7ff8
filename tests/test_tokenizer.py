"""Tokenizer, chat template and streaming helpers, checked against transformers on a tokenizer trained here and on
the official Qwen3 and Qwen2.5 tokenizers (tests/fixtures)."""
import json
import random
import shutil
import unicodedata

import pytest
from tokenizers import AddedToken, decoders, normalizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import Unigram

from pocketjax.training.bpe import CHATML_TEMPLATE, SPECIAL_TOKENS, split_holdout, stdlib_corpus, stdlib_files, train_tokenizer
from pocketjax.errors import CheckpointError, RequestError
from pocketjax.serve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

from conftest import oracle

transformers = oracle("transformers")

# Text with characters that a 1000-token vocabulary trained on Python code must split into byte tokens.
UNICODE_TEXT = "héllo wörld — naïve café. 你好，世界！ Привет мир. 😀🎉👩‍💻 ﬁ e\u0301 ½"

STRINGS = [
    "hello world",
    "",
    " ",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindented\ttabs\r\n",
    "    lots   of    spaces    \n\n  ",
    UNICODE_TEXT,
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><|im_start|>",
    "<|im_start|", "I'm you're we'LL THEY'D 12345 3.14159 0x1F",
    "\u00a0non-breaking\u2003em space\u200bzero-width",
    "a" * 300,
]

# Exercises the environment itself: tojson's options and non-ASCII, namespace, loop controls, dict(),
# strftime_now, the generation tag, the special-token variables, and undefined vs None.
ENV_TEMPLATE = """{%- set ns = namespace(n=0) %}
{%- for m in messages %}
  {%- if m.role == 'skip' %}{% continue %}{% endif %}
  {%- if m.role == 'stop' %}{% break %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
  {{- m.role }}: {% generation %}{{ m.content }}{% endgeneration %}
  {{ m | tojson }} {{ m | tojson(indent=2, sort_keys=true) }}
{% endfor %}
{{- ns.n }}|{{ dict(a=1, b=[1, 2]) | tojson(separators=(',', ':')) }}|{{ strftime_now('%Y') }}
|{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}|{{ tools is none }}|{{ documents is none }}
|{{ flavor | default('plain') }}|{{ add_generation_prompt }}
"""

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Et en français ? 你好 😀"},
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo d'une ville — °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}]

TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich and Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
    {"role": "tool", "content": "12°C"},
    {"role": "tool", "content": "15°C"},
    {"role": "assistant", "content": "Zürich 12°C, Paris 15°C.", "tool_calls": None},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Qwen2-style tokenizer folder trained on a few stdlib files plus some non-ASCII text."""
    path = tmp_path_factory.mktemp("tok")
    corpus = [p.read_text(encoding="utf-8") for p in stdlib_files()[:40]] + [UNICODE_TEXT] * 5
    train_tokenizer(corpus, 1000, path)
    return path


@pytest.fixture(scope="module")
def tok(folder):
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def test_written_folder_is_a_qwen2_tokenizer(folder, tok, hf):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer" and config["bos_token"] is None
    assert type(hf).__name__ == "Qwen2Tokenizer"
    assert tok.vocab_size == len(hf) == 1000
    assert [tok.token_id(t) for t in SPECIAL_TOKENS] == [997, 998, 999]  # specials after the merges, as in Qwen
    assert tok.eos_token_id == hf.eos_token_id == tok.token_id("<|im_end|>")
    assert tok.pad_token_id == hf.pad_token_id == tok.token_id("<|endoftext|>")
    assert tok.bos_token_id is None and hf.bos_token_id is None
    assert tok.special_token_ids == set(hf.all_special_ids) == {997, 998, 999}


@pytest.mark.parametrize("text", STRINGS)
def test_encode_decode_match_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf(text)["input_ids"] == tok.encode(text, add_special_tokens=True)  # Qwen adds no BOS
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids) == unicodedata.normalize("NFC", text)


def test_decode_of_arbitrary_ids_matches_transformers(tok, hf):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:], CONVERSATION[:3]])
def test_chatml_template_matches_transformers(tok, hf, messages, generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.endswith("<|im_start|>assistant\n") == generation_prompt
    assert tok.encode(ours) == hf.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                      return_dict=False)


# A tool conversation as OpenAI clients send it back: the call's arguments as a JSON string, the result with its
# tool_call_id. pocketjax.serve.http.tool_calls.template_messages turns it into the form the Qwen templates read.
THREE_TURNS = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 12}"},
]


@pytest.fixture(scope="module")
def official(qwen_checkpoint):
    """official(name) -> pocketjax's Tokenizer of that official Qwen tokenizer, loaded once."""
    cache = {}

    def load(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = Tokenizer.from_folder(qwen_checkpoint(name))
        return cache[name]

    return load


@pytest.fixture(scope="module")
def official_hf(qwen_checkpoint):
    """official_hf(name) -> transformers' tokenizer of the same files (the reference), loaded once."""
    cache = {}

    def load(name: str):
        if name not in cache:
            cache[name] = transformers.AutoTokenizer.from_pretrained(str(qwen_checkpoint(name)))
        return cache[name]

    return load


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
def test_official_qwen_tokenizers_load(official, name):
    tok = official(name)
    assert tok.vocab_size == {"qwen3": 151669, "qwen2.5": 151665}[name]
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643 and tok.bos_token_id is None
    assert tok.token_id("<tool_call>") == 151657 and tok.token_id("</tool_call>") == 151658
    ids = tok.encode("<|im_start|>user\nhéllo 你好<|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645 and tok.decode(ids) == "user\nhéllo 你好"
    assert tok.decode([151657]) == "<tool_call>"  # not special: a tool call's markup survives decoding


@pytest.mark.parametrize("case", ["system", "default_system", "no_prompt", "tools", "tool_calls", "three_turns"])
@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
def test_official_qwen_templates_match_transformers(official, official_hf, name, case):
    tok, hf = official(name), official_hf(name)
    kwargs = {
        "system": dict(conversation=CONVERSATION),
        "default_system": dict(conversation=CONVERSATION[1:]),
        "no_prompt": dict(conversation=CONVERSATION[:3], add_generation_prompt=False),
        "tools": dict(conversation=CONVERSATION, tools=TOOLS),
        "tool_calls": dict(conversation=TOOL_CONVERSATION, tools=TOOLS),
        "three_turns": dict(conversation=THREE_TURNS, tools=TOOLS),
    }[case]
    kwargs.setdefault("add_generation_prompt", True)
    expected = hf.apply_chat_template(tokenize=False, **kwargs)
    ours = tok.apply_chat_template(kwargs.pop("conversation"), **kwargs)
    assert ours == expected
    assert tok.encode(ours) == hf(expected, add_special_tokens=False)["input_ids"]
    if case in ("tool_calls", "three_turns"):
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in expected
    if case == "three_turns":
        assert '<tool_response>\n{"temperature": 12}\n</tool_response>' in expected


@pytest.mark.parametrize("kwargs", [{"add_generation_prompt": True}, {"add_generation_prompt": False},
                                    {"add_generation_prompt": False, "flavor": "spicy", "eos_token": "EOS!"}])
def test_template_environment_matches_transformers(tok, hf, kwargs):
    messages = [*CONVERSATION[:2], {"role": "skip", "content": "x"}, {"role": "assistant", "content": "«ok»",
                                    "meta": {"z": 1, "a": [None, True, 1.5]}},
                {"role": "stop", "content": "y"}, {"role": "user", "content": "never"}]
    expected = hf.apply_chat_template(messages, tokenize=False, chat_template=ENV_TEMPLATE, **kwargs)
    assert tok.apply_chat_template(messages, chat_template=ENV_TEMPLATE, **kwargs) == expected
    assert '"«ok»"' in expected  # tojson keeps non-ASCII, unlike Jinja's own filter


def test_continue_final_message_matches_transformers(tok, hf):
    messages = [*CONVERSATION[:2], {"role": "assistant", "content": "The answer is"}]
    expected = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    ours = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == expected and ours.endswith("The answer is")


def test_transformers5_saved_folder_loads(hf, tmp_path):
    # transformers 5 moves the template to chat_template.jinja and specials to extra_special_tokens.
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.chat_templates == {"default": CHATML_TEMPLATE}
    assert tok.apply_chat_template(CONVERSATION) == hf.apply_chat_template(CONVERSATION, tokenize=False,
                                                                            add_generation_prompt=True)
    assert tok.encode(STRINGS[6]) == hf(STRINGS[6])["input_ids"]
    assert tok.special_token_ids == {997, 998, 999}


def test_tokens_declared_only_in_config_are_added_like_transformers(folder, tmp_path):
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["1000"] = {"content": "<tool_call>", "lstrip": False, "normalized": False,
                                              "rstrip": False, "single_word": False, "special": False}
    config["additional_special_tokens"] = ["<|im_start|>", "<|extra|>"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "a<tool_call>b<|extra|>c<|im_end|>"
    assert tok.encode(text) == hf(text)["input_ids"] == [tok.encode("a")[0], 1000, tok.encode("b")[0], 1001,
                                                         tok.encode("c")[0], 999]
    assert tok.decode(tok.encode(text)) == hf.decode(hf(text)["input_ids"], skip_special_tokens=True)
    assert tok.special_token_ids == set(hf.all_special_ids) == {997, 998, 999, 1001}
    assert tok.vocab_size == len(hf) == 1002


def test_template_errors_are_request_errors(tok):
    with pytest.raises(RequestError, match="no chat template"):
        Tokenizer(tok.backend, {}).apply_chat_template(CONVERSATION)
    with pytest.raises(RequestError, match="roles must alternate"):
        tok.apply_chat_template(CONVERSATION, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(RequestError):
        tok.apply_chat_template([])
    with pytest.raises(CheckpointError):
        tok.apply_chat_template(CONVERSATION, chat_template="{% if %}")


def test_missing_or_corrupt_tokenizer_json(folder, tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    shutil.copy(folder / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_folder(tmp_path)


def _stream(detok, ids):
    pieces = [detok.add(i) for i in ids]
    return pieces, "".join(pieces) + detok.flush()


def test_incremental_detokenizer_holds_split_characters(tok):
    ids = tok.encode(UNICODE_TEXT + " done")
    pieces, text = _stream(IncrementalDetokenizer(tok), ids)
    assert text == tok.decode(ids) == UNICODE_TEXT.replace("e\u0301", "\u00e9") + " done"
    assert "" in pieces  # some character really was split across tokens
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_detokenizer_with_prompt_and_specials(tok):
    prompt = tok.encode(tok.apply_chat_template(CONVERSATION))
    ids = tok.encode("Bonjour 😀 !<|im_end|>")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
        _, text = _stream(detok, ids)
        assert text == detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_random_ids(tok):
    # Random byte tokens make invalid UTF-8, in the prompt too; held bytes come out (as U+FFFD) only at flush.
    rng = random.Random(1)
    for _ in range(30):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 12))]
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        for skip in (True, False):
            _, text = _stream(IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip), ids)
            assert text == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_prompt_ending_inside_a_character(tok):
    # The generated bytes that finish the prompt's last character are text of their own: U+FFFD, as in decode.
    ids = tok.encode("ab 你好 cd 😀!")
    cuts = [n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd")]
    assert len(cuts) >= 4
    for n in cuts:
        pieces, text = _stream(IncrementalDetokenizer(tok, ids[:n]), ids[n:])
        assert text == tok.decode(ids[n:]) and text.startswith("\ufffd") and "ab" not in text


def _sentencepiece_tokenizer():
    """A Llama-2-style tokenizer: "▁" for spaces, byte fallback, and a decoder that strips the leading space."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁Hello", "▁world", "!"]
    backend = BackendTokenizer(Unigram([(p, -1.0) for p in pieces], unk_id=0, byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(backend, {})


def test_incremental_detokenizer_keeps_sentencepiece_leading_space():
    sp = _sentencepiece_tokenizer()
    prompt, ids = sp.encode("Hello"), sp.encode("Hello world! 你 好")[1:-2]  # ends inside 好
    assert sp.backend.id_to_token(ids[0]) == "▁world" and sp.decode(ids) == "world! 你 \ufffd"
    pieces, text = _stream(IncrementalDetokenizer(sp, prompt), ids)
    assert pieces[0] == " world" and text == " world! 你 \ufffd" == sp.decode(prompt + ids)[len("Hello"):]
    assert _stream(IncrementalDetokenizer(sp), ids)[1] == sp.decode(ids)  # without a prompt: decode's text


def _match(stop, pieces):
    matcher = StopStringMatcher(stop)
    out = [matcher.add(p) for p in pieces]
    return out, matcher.flush(), matcher


def test_stop_string_spanning_pieces():
    out, tail, m = _match(["STOP"], ["abc ST", "O", "P and more", "ignored"])
    assert out == ["abc ", "", "", ""] and tail == "" and m.stopped and m.matched == "STOP"


def test_stop_string_at_start_and_first_to_end_wins():
    out, _, m = _match(["\n\n", "User:"], ["User: hi\n\n"])
    assert out == [""] and m.matched == "User:"
    # "bc" completes before "abcd" would, however the text is cut into pieces.
    for pieces in (["xab", "cd"], ["xabcd"], list("xabcd")):
        out, _, m = _match(["abcd", "bc"], pieces)
        assert "".join(out) == "xa" and m.matched == "bc"


def test_stop_string_no_false_positive_and_release():
    out, tail, m = _match(["<end>"], ["a <e", "nd", "x> b <", "en"])
    assert not m.stopped
    assert "".join(out) == "a <endx> b " and tail == "<en"
    assert "".join(out) + tail == "a <endx> b <en"


def test_stop_string_rejects_empty():
    with pytest.raises(RequestError):
        StopStringMatcher([""])


def test_training_is_deterministic_and_stdlib_corpus(tmp_path):
    files = stdlib_files()
    assert files == sorted(files) and not any("test" in p.parts or "site-packages" in p.parts for p in files)
    full = stdlib_corpus()
    assert len(full) > 500 and full[0] == files[0].read_text(encoding="utf-8")
    corpus = full[:8]
    train_tokenizer(corpus, 400, tmp_path / "a")
    train_tokenizer(corpus, 400, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    train, held = split_holdout(list(range(100)), every=10)
    assert len(held) == 10 and not set(train) & set(held)
