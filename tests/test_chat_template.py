"""The chat-template surface around the model's own template: the helpers
transformers gives templates (strftime_now, raise_exception) and
--chat-template (a file or the template itself, refused before the load when
it is neither or does not parse)."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from backends.errors import InvalidRequestError
from service.chat_template import render_chat
from service.cli import build_parser, engine_args_from
from service.config import EngineArgs
from service.engine_factory import create_engine, read_chat_template

# As Llama 3.x templates do: the system header carries today's date from
# strftime_now unless the caller passes date_string.
DATED = ("{% if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y') %}"
         "{% endif %}Today: {{ date_string }}\n"
         "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
USER = [{"role": "user", "content": "hi"}]


def test_strftime_now_renders_today_and_a_kwarg_overrides_it():
    before = datetime.now()
    text = render_chat(DATED, USER)
    days = {(before + timedelta(days=d)).strftime("%d %b %Y") for d in (0, 1)}
    assert text.splitlines()[0] in {f"Today: {d}" for d in days}
    assert render_chat(DATED, USER, date_string="01 Jan 2020").startswith("Today: 01 Jan 2020")


def test_raise_exception_is_a_400_naming_messages():
    template = ("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}"
                "{% endif %}ok")
    assert render_chat(template, USER) == "ok"
    with pytest.raises(InvalidRequestError, match="user first") as err:
        render_chat(template, [{"role": "assistant", "content": "x"}])
    assert err.value.param == "messages"


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(DATED)
    assert read_chat_template(str(path)) == DATED
    assert read_chat_template(DATED) == DATED
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        read_chat_template("{% for m in messages %}")
    ns = build_parser().parse_args(["serve", "some/model", "--chat-template", str(path)])
    assert engine_args_from(ns).chat_template == str(path)


def test_a_bad_chat_template_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="--chat-template"):
        create_engine(EngineArgs(model=str(tmp_path / "no-such-model"),
                                 chat_template="{{ unclosed"))
