"""The offline API's process ends cleanly when a script leaves without LLM.shutdown(), even mid-step.

Before LLM stopped its engine at exit, the engine thread (a daemon) took the GIL back during the
interpreter's finalization after a torch op, and pthread_exit's unwinding through torch's C++ aborted
the process: "terminate called without an active exception", exit code 134.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from gpushare.llm import LLM
    from gpushare.protocol.sampling_params import SamplingParams

    llm = LLM(sys.argv[1], kv_cache_bytes=256 << 20)
    prompt = [1000 + i for i in range(2000)]  # a prefill step of ~1-2 s, under way as we leave
    threading.Thread(target=llm.generate, args=([prompt], SamplingParams(max_tokens=4)), daemon=True).start()
    time.sleep(0.5)
    print("leaving", flush=True)
""")


def test_a_script_that_leaves_while_a_step_runs_exits_with_0(smollm2_path):
    run = subprocess.run([sys.executable, "-c", SCRIPT, smollm2_path], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "leaving" in run.stdout
    assert "terminate called" not in run.stderr
