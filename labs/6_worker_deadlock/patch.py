"""A DataLoader worker deadlocks: its rank waits for a batch, the others in a collective."""

PATCH = [
    ("def train(", "before",
     "import threading  # lab 6\n"
     "held = threading.Lock()  # lab 6: held by the rank when the DataLoader forks (a logging thread's may be)\n"
     "\n"
     "\n"
     "def wait_for_lock(worker_id):  # lab 6: the worker's copy stays held: what would release it is not in the worker\n"
     "    with held:\n"
     "        pass\n"
     "\n"),
    ("for batch_idx, (x, y) in enumerate(loader):", "before",
     "if dist.get_rank() == 1:  # lab 6: rank 1 holds the lock while its DataLoader worker starts\n"
     "    loader.worker_init_fn = wait_for_lock\n"
     "    held.acquire()"),
]  # fmt: skip
ARGS = ["--epochs", "1", "--limit", "512", "--num-workers", "1"]
TOOLS = ["py-spy"]
