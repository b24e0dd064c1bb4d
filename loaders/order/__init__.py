"""Who reads what, as pure arithmetic (numpy; no I/O, no torch).

`layout` (a reader's place: `Layout`, its progress: `Cursor`, and how a rank's stream is dealt to
its workers), `windows` (an epoch's global order as a function of position: shuffle windows and
their permutation, dealt to ranks), `permute` (the keyed bijection inside a window), `cold` (a first
epoch's dealing of whole shards while counts arrive) and `mixed` (a mix of sources as one order).
"""
