"""What each instruction of a compiled program is: matmul, attention, a collective kind, other.

A profiler trace names the HLO instruction each op ran (`hlo_op`) and little
else; the compiled program's text (`jitted.lower(*args).compile().as_text()`)
says what the instruction is: its opcode, the computation a fusion calls (a
fusion holding a `dot` is a matmul), and its source (`metadata={op_name=...
stack_frame_id=...}` and the module's `FileNames`/`StackFrames` tables).

Categories (`CATEGORIES`):

- a collective kind (`COLLECTIVES`) by opcode, async `-start`/`-done` pairs
  included (`send`/`recv` count as collective-permute: point to point);
- "control": `while`, `conditional`, `call`: they contain other ops, so the
  timeline gives them only the time none of their ops covers;
- "attention": any op whose source is an attention kernel (shardfuse's
  `kernels/attention/` and `collectives/ring_attention/`) or whose op name
  says attention (`jax.nn.dot_product_attention`, cuDNN fused attention),
  and every compute op of a computation whose compute ops are at least half
  attention (a fused score matmul can lose the kernel's frames);
- "matmul": `dot`, `convolution`, a fusion calling one, a GEMM custom call;
- "other": everything else (elementwise, reductions, copies, layout changes).

Without the program text, `classify_name` guesses from the op name alone.
"""

import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
COMPUTE = ("matmul", "attention", "other")
CONTROL = "control"
CATEGORIES = COMPUTE + COLLECTIVES + (CONTROL,)

_COLLECTIVE_OPCODES = {
    "all-reduce": "all-reduce",
    "all-gather": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "collective-permute": "collective-permute",
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "collective-broadcast": "all-gather",
    "send": "collective-permute",
    "recv": "collective-permute",
}
_CONTROL_OPCODES = ("while", "conditional", "call", "async-start", "async-done")
_BOOKKEEPING_OPCODES = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast")
_MATMUL_OPCODES = ("dot", "convolution", "ragged-dot", "scaled-dot")
_MATMUL_TARGET = re.compile(r"gemm|matmul|cublas|onednn\$(matmul|conv)|dot", re.IGNORECASE)
_ATTENTION_SOURCE = re.compile(r"kernels/attention/|collectives/ring_attention/")
_ATTENTION_NAME = re.compile(r"attention|fmha|flash", re.IGNORECASE)

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+([a-z][\w\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")


def _collective_kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start").removesuffix("-done")
    return _COLLECTIVE_OPCODES.get(base)


def classify_name(name: str) -> str:
    """A category guessed from an op's name alone (no program text).

    Example:
      >>> from shardfuse.profile.hlo import classify_name
      >>> classify_name("all-reduce.3"), classify_name("dot_general.7"), classify_name("add.1")
      ('all-reduce', 'matmul', 'other')
    """
    lowered = name.lower().replace("_", "-")
    for key in ("reduce-scatter", "all-gather", "all-to-all", "all-reduce"):
        if key in lowered:
            return key
    if "collective-permute" in lowered or "ppermute" in lowered:
        return "collective-permute"
    if re.match(r"(while|conditional|call)\b", lowered):
        return CONTROL
    if _ATTENTION_NAME.search(lowered):
        return "attention"
    if re.search(r"\bdot\b|dot-general|gemm|matmul|convolution", lowered):
        return "matmul"
    return "other"


_PLUMBING = re.compile(
    r"^(while|body|cond|closed_call|shard_map|branch_\d+_fun|jvp\(.*\)|checkpoint|remat)$"
)


def op_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name -> a short source scope from its `op_name` ("bwd " for the backward pass).

    Example:
      >>> from shardfuse.profile.hlo import op_scopes
      >>> path = "jit(f)/transpose(jvp())/while/body/mlp/up/dot_general"
      >>> line = f'  %dot.3 = f32[2]{{0}} dot(%a, %b), metadata={{op_name="{path}"}}'
      >>> op_scopes(line)
      {'dot.3': 'bwd mlp/up/dot_general'}
    """
    scopes = {}
    for line in hlo_text.splitlines():
        match, op_name = _INSTRUCTION.match(line), _OP_NAME.search(line)
        if match is None or op_name is None:
            continue
        parts = [
            p
            for p in op_name.group(1).split("/")
            if p and not _PLUMBING.match(p) and not p.startswith(("jit(", "transpose("))
        ]
        backward = "bwd " if "transpose(" in op_name.group(1) else ""
        scopes[match.group(1)] = backward + "/".join(parts[-3:])
    return scopes


def _tables(lines):
    """`{table: {id: text}}` of the FileNames, FunctionNames, FileLocations, StackFrames blocks."""
    tables, current = {}, None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        if current is None:
            continue
        match = _TABLE_ROW.match(line)
        if match is None:
            current = None
            continue
        current[int(match.group(1))] = match.group(2)
    return tables


def _frame_sources(tables) -> dict[int, str]:
    """Stack frame id -> the files and functions of the frame and its parents, one string."""
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        file_id = re.search(r"file_name_id=(\d+)", v)
        function_id = re.search(r"function_name_id=(\d+)", v)
        locations[k] = (
            files.get(int(file_id.group(1)), "") if file_id else "",
            functions.get(int(function_id.group(1)), "") if function_id else "",
        )
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        location = re.search(r"file_location_id=(\d+)", v)
        parent = re.search(r"parent_frame_id=(\d+)", v)
        frames[k] = (
            int(location.group(1)) if location else 0,
            int(parent.group(1)) if parent else 0,
        )
    sources = {}
    for frame_id in frames:
        parts, seen, current = [], set(), frame_id
        while current in frames and current not in seen:
            seen.add(current)
            location, parent = frames[current]
            parts.append(" ".join(locations.get(location, ("", ""))))
            current = parent
        sources[frame_id] = " ".join(parts)
    return sources


def classify_program(hlo_text: str) -> dict[str, str]:
    """Instruction name -> category (`CATEGORIES`) for every instruction of a compiled program.

    Args:
      hlo_text: `compiled.as_text()` (optimized HLO, with its metadata tables).

    Example:
      >>> from shardfuse.profile.hlo import classify_program
      >>> text = '''ENTRY %main (p: f32[4,4]) -> f32[4,4] {
      ...   %p = f32[4,4]{1,0} parameter(0)
      ...   %dot.1 = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}
      ...   ROOT %all-reduce.2 = f32[4,4]{1,0} all-reduce(%dot.1), to_apply=%add
      ... }'''
      >>> classify_program(text)["dot.1"], classify_program(text)["all-reduce.2"]
      ('matmul', 'all-reduce')
    """
    lines = hlo_text.splitlines()
    sources = _frame_sources(_tables(lines))
    opcodes_in: dict[str, set] = {}  # computation -> the opcodes in it
    fusions_in: dict[str, list] = {}  # computation -> the computations its fusions call
    instructions = []  # (name, opcode, line, computation)
    computation = None
    for line in lines:
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("{", 1)[0]:
            computation = header.group(1)
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, opcode = match.groups()
        if computation is not None:
            opcodes_in.setdefault(computation, set()).add(opcode)
            if opcode == "fusion":
                fusions_in.setdefault(computation, []).extend(_CALLS.findall(line))
        instructions.append((name, opcode, line, computation))

    def holds_matmul(called, depth=0):
        if opcodes_in.get(called, set()) & set(_MATMUL_OPCODES):
            return True
        return depth < 4 and any(holds_matmul(c, depth + 1) for c in fusions_in.get(called, ()))

    categories = {}
    for name, opcode, line, _ in instructions:
        kind = _collective_kind(opcode)
        if kind is not None:
            categories[name] = kind
            continue
        if opcode in _CONTROL_OPCODES:
            categories[name] = CONTROL
            continue
        op_name = _OP_NAME.search(line)
        frame = _FRAME.search(line)
        source = (op_name.group(1) if op_name else "") + " "
        source += sources.get(int(frame.group(1)), "") if frame else ""
        if _ATTENTION_SOURCE.search(source) or _ATTENTION_NAME.search(
            op_name.group(1) if op_name else ""
        ):
            categories[name] = "attention"
            continue
        target = _TARGET.search(line)
        matmul = opcode in _MATMUL_OPCODES
        matmul |= opcode == "fusion" and any(holds_matmul(c) for c in _CALLS.findall(line))
        matmul |= opcode == "custom-call" and bool(
            target and _MATMUL_TARGET.search(target.group(1))
        )
        categories[name] = "matmul" if matmul else "other"
    return _attention_computations(categories, instructions)


def _attention_computations(categories: dict, instructions: list) -> dict:
    """Relabel the compute ops of a computation that is mostly attention as attention.

    XLA keeps one op's metadata when it fuses or simplifies several, and some
    keep none of the kernel's frames (a score matmul fused in a flash-attention
    loop body); the ops around them say what the body is.
    """
    members: dict = {}
    for name, opcode, _, computation in instructions:
        if opcode not in _BOOKKEEPING_OPCODES and categories[name] in COMPUTE:
            members.setdefault(computation, []).append(name)
    for names in members.values():
        attention = sum(categories[n] == "attention" for n in names)
        if 2 * attention >= len(names):
            for n in names:
                categories[n] = "attention"
    return categories
