"""The options: what a flag turns on, one module per option or family of options, read when it is
used. A stage enters each at a line marked `# option:`; a default run reads none of them."""
