"""`gpushare run`'s interactive chat through a pseudo-terminal (pexpect), as a person types it:
/set parameter, a \"\"\" multiline message, /show, /save, an unknown command, /bye, and the
history file read back by the next run (the Up arrow recalls the last line)."""

import pexpect
import pytest
from daemon_fixture import GPUSHARE, MODEL, http, serving

from gpushare import SamplingParams

PROMPT = ">>> "


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    # no warm tier: an unloaded model loads again from its file, with progress to show
    with serving(tmp_path_factory.mktemp("run"), smollm2_path, {"memory": {"host_cache": 0}}) as d:
        yield d


def start(daemon, *args) -> pexpect.spawn:
    child = pexpect.spawn(str(GPUSHARE), ["run", MODEL, *args], env={**daemon.env(), "TERM": "xterm"},
                          encoding="utf-8", timeout=180, dimensions=(40, 200))
    child.expect_exact(PROMPT)
    return child


def test_interactive_commands_multiline_and_history(daemon, served_llm):
    expected = served_llm.chat([{"role": "user", "content": "Say\nhello"}],
                               SamplingParams(temperature=0, max_tokens=8))[0].text
    child = start(daemon)
    child.sendline("/set parameter temperature 0")
    child.expect_exact("Set parameter 'temperature' to '0'")
    child.sendline("/set parameter num_predict 8")
    child.expect_exact("Set parameter 'num_predict' to '8'")
    child.expect_exact(PROMPT)
    child.sendline('"""Say')
    child.expect_exact("... ")
    child.sendline('hello"""')
    child.expect_exact(PROMPT)
    answer = child.before.replace("\r\n", "\n")
    assert answer.endswith(expected + "\n")
    child.sendline("/show info")
    child.expect(r"architecture\s+llama")
    child.sendline("/show parameters")
    child.expect(r"num_predict\s+8")
    child.sendline("/set system You are a pirate.")
    child.expect_exact("Set system message.")
    child.sendline("/show system")
    child.expect_exact("You are a pirate.")
    child.sendline("/sett parameter x")
    child.expect_exact("Unknown command '/sett'. Type /? for help")
    child.sendline("/save pirate-session")
    child.expect_exact("Created new model 'pirate-session'")
    child.sendline("/load pirate-session")
    child.expect_exact("Loading model 'pirate-session'")
    child.expect_exact(PROMPT)
    child.sendline("/show system")  # the session's own system message still wins
    child.expect_exact("You are a pirate.")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    shown = http("POST", daemon.url + "/api/show", {"model": "pirate-session"})[1]
    assert shown["system"] == "You are a pirate." and "num_predict                    8" in shown["parameters"]
    assert shown["messages"][0] == {"role": "user", "content": "Say\nhello"}

    for model in ("pirate-session", MODEL):  # unloaded: the next run shows its load
        http("POST", daemon.url + "/api/generate", {"model": model, "keep_alive": 0, "stream": False})
    child = pexpect.spawn(str(GPUSHARE), ["run", MODEL], env={**daemon.env(), "TERM": "xterm"}, encoding="utf-8",
                          timeout=180, dimensions=(40, 200))
    child.expect(r"loading smollm2:135m 100% \[#+\]")  # the progress bar, redrawn in place
    child.expect_exact(PROMPT)  # a new run: the Up arrow brings back the last line typed before
    child.send("\x1b[A")
    child.expect_exact("/bye")
    child.send("\x15/bye\r")  # Ctrl-U clears the recalled line
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
