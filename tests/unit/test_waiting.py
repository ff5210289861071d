"""The tests' one way to wait (tests/helpers/waiting.py): what it returns, and what its failures say."""

import asyncio
import sys
import time

import pytest

from tests.helpers.waiting import wait_until, wait_until_async


def test_it_returns_the_first_truthy_value_of_the_condition():
    values = iter([None, [], 0, ["found"]])
    assert wait_until(lambda: next(values), "a value", 5, interval=0.01) == ["found"]


def test_on_timeout_it_names_what_it_waited_for_how_long_and_the_last_value():
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        wait_until(lambda: [], "the groups of v3", 0.3, interval=0.05)
    message = str(failure.value)
    assert time.monotonic() - started < 5
    assert message.startswith("waited 0.") and "for the groups of v3: not within 0.3 s" in message, message
    assert "the condition last gave []" in message, message


def test_a_watched_process_that_exits_fails_the_wait_at_once_with_the_end_of_its_log(procs):
    died = procs.start_argv("dies", ["-c", "import sys; sys.stderr.write('out of luck\\n'); sys.exit(3)"])
    alive = procs.start_argv("lives", ["-c", "import time; time.sleep(60)"])
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        wait_until(lambda: False, "a file that never comes", 60, [alive, died])
    message = str(failure.value)
    assert time.monotonic() - started < 30, "it waited out the timeout"
    assert "a watched process exited first" in message and f"process {died.pid} (dies) exited with 3" in message
    assert message.endswith("out of luck\n"), message
    assert f"process {alive.pid}" not in message, "only the dead process's log"


def test_a_condition_that_comes_true_as_the_process_exits_is_not_a_failure(procs):
    done = procs.start_argv("done", ["-c", "pass"])
    done.wait(timeout=30)
    assert wait_until(lambda: done.returncode == 0, "the process to finish", 5, [done])


def test_a_piped_stderr_is_the_log_of_a_process_started_elsewhere():
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "raise SystemExit('no way')"], stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(AssertionError, match="no way"):
            wait_until(lambda: False, "anything", 60, [p])
    finally:
        p.wait(timeout=30)
        p.stderr.close()


def test_the_coroutine_form_lets_the_event_loop_run_while_it_waits():
    async def scenario():
        flag = []
        asyncio.get_running_loop().call_later(0.1, flag.append, "set by the loop")
        return await wait_until_async(lambda: flag, "the loop's callback", 5)

    assert asyncio.run(scenario()) == ["set by the loop"]
