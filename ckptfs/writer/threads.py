"""Threads of a writer that must not be cut short by Ctrl-C: its cleanups, and the start of
its own threads (without torch: ``ckptfs status``'s imports reach the progress board)."""
from __future__ import annotations

import threading
from typing import Callable


def uninterrupted(cleanup) -> None:
    """Run ``cleanup()`` to its end even where Ctrl-C (KeyboardInterrupt) comes meanwhile, then
    raise that interrupt. A save's cleanup on the caller's thread (a claim aborted, a permit and
    buffers given back, its future failed) cut short by a second Ctrl-C left a save that never
    finished, and close() and the interpreter's exit waited for it forever. Only the main
    thread is interrupted: there the cleanup runs on a thread of its own."""
    if threading.current_thread() is not threading.main_thread():
        cleanup()
        return
    failed: list[BaseException] = []
    done, once = threading.Event(), threading.Lock()

    def run() -> None:
        if not once.acquire(blocking=False):
            return  # the thread started after all, and runs it
        try:
            cleanup()
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below
            failed.append(e)
        finally:
            done.set()

    thread, interrupt = threading.Thread(target=run, name="ckptfs-cleanup"), None
    try:
        thread.start()  # waits for the thread to run: a Ctrl-C may come here too
    except KeyboardInterrupt as e:
        interrupt = e
        run()  # if the thread never started (else a no-op: it has the cleanup)
    except RuntimeError:  # no thread to be had ("can't start new thread"): here, then
        run()
    while not done.is_set():  # not Thread.join: interrupted, it can take the thread for ended
        try:
            done.wait()
        except KeyboardInterrupt as e:
            interrupt = e
    if failed:
        raise failed[0]
    if interrupt is not None:
        raise interrupt


def start_thread(target: Callable[[], None], name: str, record: Callable[[threading.Thread], None]) -> None:
    """Start a daemon thread running ``target`` and ``record`` it, as one: to its end under
    Ctrl-C (Thread.start waits for the thread to run; interrupted there, it left a thread no
    close stopped, beside the next one), and nothing recorded where it cannot start
    (RuntimeError, no memory for a stack: the caller tries again at its next need; recorded,
    everything queued for it waited for a thread never run)."""
    def start() -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        record(thread)
    uninterrupted(start)
