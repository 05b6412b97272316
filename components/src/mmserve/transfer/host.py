"""Which host a process is on, as far as shared memory goes.

Two processes share a host when they run on the same booted machine (`/proc/sys/kernel/random/
boot_id`), in the same network namespace, and see the same filesystem at the shared-memory
directory. The network namespace counts because it is what a deployment places components by:
a container or a simulated host has an address of its own, and usually a /dev/shm of its own
too; where it does not, treating it as another host only costs the faster path, never a wrong
read. The shm backend stamps its descriptors with this identity and refuses those of another.
"""

from __future__ import annotations

import os


def host_identity(shm_directory: str) -> str:
    """This host's identity, as seen from the calling thread (a thread may have entered
    another network namespace than its process's: a simulated host in the tests)."""
    with open("/proc/sys/kernel/random/boot_id") as boot:
        boot_id = boot.read().strip()
    netns = os.stat("/proc/thread-self/ns/net").st_ino
    shm_device = os.stat(shm_directory).st_dev
    return f"{boot_id}/net:{netns}/shm:{shm_device}"
