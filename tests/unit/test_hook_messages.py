"""Every message of the prestart's pipes and socket (nvctk.hook.messages): each decodes
what it encodes, and EOF alone, a message cut short or a garbled one is told apart,
never taken for another value; the channel over a real pipe, with its bounds."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from nvctk.base.fileio import TooLarge
from nvctk.hook import messages as msg
from nvctk.hook.messages import MessageError, NoAnswer


@pytest.mark.parametrize("pid", [1, 4242, 2**22])
def test_pid_round_trip(pid: int) -> None:
    assert msg.decode_pid(msg.encode_pid(pid)) == pid


def test_libraries_in_round_trip() -> None:
    sent = (2**40 + 3, 2**33 + 7, 31337)
    assert msg.decode_libraries_in(msg.encode_libraries_in(*sent)) == sent


@pytest.mark.parametrize("err", [None, "step mount: /usr/lib/x.so: boom", "",
                                 "line one\nline two", "nicht ganz \u00fcblich"])
def test_answer_round_trip(err: str | None) -> None:
    assert msg.decode_answer(msg.encode_answer(err)) == err


def test_an_answer_that_is_not_utf_8_is_still_read() -> None:
    data = b"%d:error\n\xff step" % len(b"error\n\xff step")
    assert msg.decode_answer(data) == "\ufffd step"


@pytest.mark.parametrize(("code", "text"), [(0, ""), (1, "nvctk-hook: prestart: no\n"),
                                            (255, "x" * 1000)])
def test_served_answer_round_trip(code: int, text: str) -> None:
    assert msg.decode_served_answer(msg.encode_served_answer(code, text)) == (code, text)


def test_a_served_exit_code_is_one_byte_as_the_launcher_reads_it() -> None:
    assert msg.encode_served_answer(257, "t") == b"\x01t"
    assert msg.decode_served_answer(b"") is None  # the server ended without one


def test_eof_alone_means_what_each_pipe_says() -> None:
    assert msg.decode_pid(b"") is None  # cancelled
    assert msg.decode_libraries_in(b"") is None  # the worker failed before
    assert msg.decode_set_up(msg.SET_UP) is None  # ldconfig exec'd or ended
    with pytest.raises(MessageError, match=r"^worker gave no answer$"):
        msg.decode_answer(b"")


DECODERS: dict[str, tuple[Callable[[bytes], object], bytes]] = {
    "pid pipe": (msg.decode_pid, msg.encode_pid(4242)),
    "libraries pipe": (msg.decode_libraries_in, msg.encode_libraries_in(64768, 131, 4242)),
    "the worker's answer": (msg.decode_answer, msg.encode_answer("step mount: /x: no")),
}


@pytest.mark.parametrize("pipe", DECODERS)
def test_every_cut_of_a_message_is_an_error(pipe: str) -> None:
    decode, whole = DECODERS[pipe]
    for n in range(1, len(whole)):
        with pytest.raises(MessageError) as e:
            decode(whole[:n])
        assert str(e.value).startswith(pipe), (n, str(e.value))
    decode(whole)


@pytest.mark.parametrize("pipe", DECODERS)
@pytest.mark.parametrize("data", [b"4242", b"x:4242", b"-4:4242", b"2:4242", b"9999999999:1",
                                  b":", b"\x00"])
def test_garbled_messages_are_errors(pipe: str, data: bytes) -> None:
    decode, _ = DECODERS[pipe]
    with pytest.raises(MessageError, match=r"garbled|cut short"):
        decode(data)


@pytest.mark.parametrize(("decode", "payload"), [
    (msg.decode_pid, b"0"), (msg.decode_pid, b"-1"), (msg.decode_pid, b"1 2"),
    (msg.decode_pid, b" 7"), (msg.decode_libraries_in, b"1 2"),
    (msg.decode_libraries_in, b"1 2 3 4"), (msg.decode_libraries_in, b"1  2 3"),
    (msg.decode_libraries_in, b"a b c"), (msg.decode_answer, b"okay"),
    (msg.decode_answer, b"error"), (msg.decode_answer, b"OK"),
])
def test_a_whole_frame_with_a_wrong_payload_is_an_error(decode: Callable[[bytes], object],
                                                         payload: bytes) -> None:
    with pytest.raises(MessageError):
        decode(b"%d:%s" % (len(payload), payload))


def test_the_set_up_pipe_carries_nothing() -> None:
    with pytest.raises(MessageError, match="set-up pipe"):
        msg.decode_set_up(b"x")


def test_ldconfig_output_is_text() -> None:
    assert msg.decode_output([b"  a\n", b"\xffb\n"]) == "a\n\ufffdb"


# --- the channel ---------------------------------------------------------------------------


def test_a_channel_carries_one_message_then_eof() -> None:
    r, w = msg.pipe()
    w.send(msg.encode_pid(99))
    assert w.fd == -1  # closed by send
    assert msg.decode_pid(r.recv(msg.PID_LIMIT)) == 99
    assert r.fd == -1
    r.close()  # twice: nothing


def test_a_channel_reads_no_more_than_its_bound() -> None:
    r, w = msg.pipe()
    w.send(b"x" * 65)
    with pytest.raises(TooLarge):
        r.recv(64)
    assert r.fd == -1


def test_a_channel_past_its_bound_by_a_deadline_too() -> None:
    r, w = msg.pipe()
    w.send(b"x" * 65)
    with pytest.raises(TooLarge):
        r.recv(64, deadline=time.monotonic() + 600)


def test_a_silent_writer_is_no_answer_by_the_deadline() -> None:
    r, w = msg.pipe()
    try:
        os.write(w.fd, b"3:o")  # part of a message, and the writer still open
        with pytest.raises(NoAnswer):
            r.recv(msg.ANSWER_LIMIT, deadline=time.monotonic())
        assert r.fd == -1
    finally:
        w.close()


def test_what_came_before_the_deadline_counts() -> None:
    r, w = msg.pipe()
    w.send(msg.encode_answer(None))
    # the deadline has passed, but the answer and its EOF are there
    assert msg.decode_answer(r.recv(msg.ANSWER_LIMIT, deadline=time.monotonic() - 1)) is None


def test_a_send_to_a_reader_that_is_gone_fails_and_closes() -> None:
    r, w = msg.pipe()
    r.close()
    with pytest.raises(BrokenPipeError):
        w.send(msg.encode_pid(1))
    assert w.fd == -1
