"""A volunteer's agent that lies (test_validation.py): the real vpool agent, with one of its
functions replaced, as a volunteer who controls the machine could.

argv: MODE, then the agent's own arguments. MODE ``output``: every "pi = " line its ranks
print reaches the coordinator as "pi = 3.000000000000". MODE ``messages``: every 8-byte
message its ranks send with tag 7 (a float64) reaches the relay one larger, properly sealed.
"""

import struct
import sys

from vpool.protocol import sealing
from vpool.worker_agent import cli, output


def forge_output() -> None:
    real = output.OutputChunk

    def chunk(**kw):  # what output.OutputPump posts
        data = kw["data"]
        at = data.find(b"pi = ")
        if kw["stream"] == "stdout" and at >= 0:
            end = data.find(b"\n", at)
            kw["data"] = data[: at + 5] + b"3.000000000000" + data[end:]
        return real(**kw)

    output.OutputChunk = chunk


def forge_messages() -> None:
    real = sealing.Sealer.seal

    def seal(self, msg, frame, header_len):
        plain = bytearray(frame)
        if msg.tag == 7 and len(plain) >= 8:
            (value,) = struct.unpack_from("<d", plain, len(plain) - 8)
            struct.pack_into("<d", plain, len(plain) - 8, value + 1.0)
        return real(self, msg, plain, header_len)

    sealing.Sealer.seal = seal


if __name__ == "__main__":
    {"output": forge_output, "messages": forge_messages}[sys.argv.pop(1)]()
    cli.main()
