"""Binary byte units. Sizes are counted in bytes everywhere; these turn them into the MiB and GiB
that messages, tables and command-line options speak in."""

MiB = 2**20
GiB = 2**30
