"""The learner's side of the notebooks: puzzles (the learner writes a stage's central code from a spec and a
stub) and exercises, with checkers importable so that a test runs each one on the stub, on plausible wrong
answers and on a solution (``tests/test_exercises_*.py``).

One module per notebook; a checker builds its own cases, prints ``passed: ...`` or raises
:class:`flashlib.checks.CheckFailed` with a message that names the failing case in words and the likely mistake.
Puzzles are :class:`~flashlib.exercises.puzzle.Puzzle` objects (checker, solution, graded hints; the notebook
falls back to the solution until the learner's version passes); the exercises at each notebook's end are
``Puzzle`` objects too, labelled ``"exercise N: ..."``, with the same graded hints and solution. Every checker
belongs to one, so mutation testing (``make mutants``, ``tests/mutants.py``) reaches all of them.

==========================  ========  ======================================================================
module                      notebook  what the learner writes
==========================  ========  ======================================================================
``start_here``              00        the first checks
``softmax``                 01        stable softmax, attention from it
``tiling``                  02        tiled QK^T and PV
``online_softmax``          03        the online update, the state merge, a merge tree
``flash_jax``               04        blockwise flash attention with causal masking and padding
``pallas_basics``           05        a BlockSpec / index-map kernel, an accumulator kernel
``flash_kernel``            06        the forward kernel's body, causal skipping with a clamped index map
``compaction``              06        the compacted causal grid: the live steps' tables and the
                                      ``PrefetchScalarGridSpec`` index maps that read them
``backward``                07        the dK/dV kernel with causal skipping, the dQ kernel
``performance``             08        block sizes chosen by the compiler's estimate under a VMEM budget
``variants``                09        the element rule of causal + window + segments, a soft-cap and a sink in
                                      the forward kernel, a block's kind under a window
``decoding``                10        the output from split-KV states, the page a paged index map copies
``decoding_kernel``         10        the paged decode kernel in Pallas: its index map clamped over the block
                                      table, its body (pages past the length skipped, the last page masked)
``scaling_out``             11        one ring-attention step (merge by log-sum-exp), the causal imbalance
``sharded_ring``            11        the ring's forward with ``shard_map`` and ``ppermute``; a striped ring's
                                      imbalance, the backward ring's transfer against its compute
==========================  ========  ======================================================================

Where a module would pass 400 lines, its teaching solutions (what ``Puzzle.solution`` points at, and what the
hints' last level prints) live beside it in ``<module>_solutions`` (``softmax``, ``tiling``, ``online_softmax``,
``flash_jax``, ``pallas_basics``, ``flash_kernel``, ``backward``, ``performance``, ``variants``, ``decoding``).

This package sits at the top of the layers (it checks every stage, kernels and estimates included); nothing in
the library imports it.
"""
