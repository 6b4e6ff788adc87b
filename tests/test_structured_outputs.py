"""Regex, choice and grammar formats end to end: requests to a live server on a random tiny model, in each
spelling a client may use (response_format, vLLM's structured_outputs and guided_* fields, /v1/completions
too); every answer that stops is one the format describes, and bad formats are 400s naming the field."""
import re

import openai
import pytest


PHONE = r"[0-9]{3}-[a-z]{2,4}"
COLORS = ["red", "green", "blue", "dark blue"]
LARK = 'start: "(" NUM ("+" NUM){0,2} ")"\nNUM: /[1-9][0-9]?/\n'
GBNF = 'root ::= "The answer is " ("yes" | "no") "."\n'


def chat(http, srv, n=6, **fields):
    body = {"model": srv.model, "max_tokens": 24, "temperature": 1.0, "seed": 7, "n": n,
            "messages": [{"role": "user", "content": "Answer."}], **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return [(c["message"]["content"], c["finish_reason"]) for c in r.json()["choices"]]


def stopped(answers):
    done = [text for text, reason in answers if reason == "stop"]
    assert done, answers   # the formats here end by themselves, well within max_tokens
    return done


@pytest.mark.parametrize("fields", [{"response_format": {"type": "regex", "regex": PHONE}},
                                    {"response_format": {"type": "regex_schema", "regex_schema": PHONE}},
                                    {"response_format": {"type": "grammar", "syntax": "regex", "definition": PHONE}},
                                    {"structured_outputs": {"regex": PHONE}}, {"guided_regex": PHONE}])
def test_regex_answers_match_the_whole_pattern(srv, http, fields):
    answers = chat(http, srv, **fields)
    for text in stopped(answers):
        assert re.fullmatch(PHONE, text), text
    for text, _ in answers:
        assert re.fullmatch(r"[0-9]{0,3}(-[a-z]{0,4})?", text), text   # cut by max_tokens: still a prefix


@pytest.mark.parametrize("fields", [{"response_format": {"type": "choice", "choice": COLORS}},
                                    {"structured_outputs": {"choice": COLORS}}, {"guided_choice": COLORS}])
def test_choice_answers_are_one_of_the_choices(srv, http, fields):
    answers = chat(http, srv, **fields)
    assert all(reason == "stop" and text in COLORS for text, reason in answers), answers


@pytest.mark.parametrize("fields,pattern", [
    ({"response_format": {"type": "grammar", "grammar": LARK}}, r"\([1-9][0-9]?(\+[1-9][0-9]?){0,2}\)"),
    ({"response_format": {"type": "grammar", "syntax": "lark", "definition": LARK}}, r"\([1-9][0-9]?(\+[1-9][0-9]?){0,2}\)"),
    ({"structured_outputs": {"grammar": GBNF}}, r"The answer is (yes|no)\."),
    ({"guided_grammar": GBNF}, r"The answer is (yes|no)\.")])
def test_grammar_answers_parse(srv, http, fields, pattern):
    for text in stopped(chat(http, srv, **fields)):
        assert re.fullmatch(pattern, text), text


def test_completions_and_the_openai_sdk_take_formats_too(srv):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    r = c.completions.create(model=srv.model, prompt="Color:", max_tokens=16, temperature=1.0, seed=1, n=4,
                             extra_body={"guided_choice": COLORS})
    assert all(ch.text in COLORS and ch.finish_reason == "stop" for ch in r.choices), r.choices
    r = c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "Answer."}], max_tokens=24,
                                  temperature=0, extra_body={"structured_outputs": {"json": {
                                      "type": "object", "properties": {"ok": {"type": "boolean"}},
                                      "required": ["ok"]}}})
    ch = r.choices[0]
    assert ch.finish_reason != "stop" or ch.message.content.replace(" ", "") in ('{"ok":true}', '{"ok":false}')
    stream = c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "Answer."}],
                                       max_tokens=24, temperature=1.0, seed=2, stream=True,
                                       extra_body={"guided_regex": PHONE})
    text = "".join(x.choices[0].delta.content or "" for x in stream if x.choices)
    assert re.fullmatch(r"[0-9]{0,3}(-[a-z]{0,4})?", text), text


@pytest.mark.parametrize("fields,param,fragment", [
    ({"response_format": {"type": "regex", "regex": "a(b"}}, "response_format", "unclosed group"),
    ({"guided_regex": "[z-a]"}, "guided_regex", "invalid regex"),
    ({"response_format": {"type": "grammar", "grammar": "start: foo"}}, "response_format", 'unknown name: "foo"'),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "GBNF"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"response_format": {"type": "regex"}}, "response_format", "needs its regex field"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs", "not supported"),
    ({"guided_json": "{x"}, "guided_json", "not JSON"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one answer format"),
    ({"response_format": {"type": "grammar", "grammar": 'start: <|no_such_token|>'}}, None, "special token"),
])
def test_bad_formats_are_400s_naming_the_field(srv, http, fields, param, fragment):
    body = {"model": srv.model, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **fields}
    r = http.post("/v1/chat/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and fragment in error["message"] and "\n" not in error["message"], r.text
    assert error["param"] == param, error
