"""The classic pipeline timeline chart of a `ScheduleTable` (matplotlib, optional)."""

COLORS = {1: "#4c72b0", 2: "#55a868", 3: "#c44e52"}  # F, B, W


def plot_table(table, path: str) -> None:
    """Draws `table` as one row of boxes per stage (F blue, B green, W red, idle blank).

    Each box is one tick, labelled with its microbatch (and chunk when v > 1);
    the title gives the bubble. Needs matplotlib (`pip install 'shardfuse[plot]'`).

    Example usage::

      >>> import tempfile, os
      >>> from shardfuse.parallel.pipeline.schedule import schedule_table
      >>> path = os.path.join(tempfile.mkdtemp(), "1f1b.png")
      >>> plot_table(schedule_table("1f1b", 2, 4), path)
      >>> os.path.getsize(path) > 0
      True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ticks, stages = table.num_ticks, table.num_stages
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * ticks), 0.6 * stages + 1.2))
    for s in range(stages):
        for t in range(ticks):
            kind = int(table.kind[t, s])
            if kind == 0:
                continue
            ax.add_patch(plt.Rectangle((t, stages - 1 - s), 1, 0.9, color=COLORS[kind], alpha=0.85))
            ax.text(
                t + 0.5,
                stages - 1 - s + 0.45,
                table.label(t, s)[1:],
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_xlim(0, ticks)
    ax.set_ylim(0, stages)
    ax.set_yticks([stages - 1 - s + 0.45 for s in range(stages)])
    ax.set_yticklabels([f"stage {s}" for s in range(stages)])
    ax.set_xlabel("tick")
    v = f" v={table.virtual_stages}" if table.virtual_stages > 1 else ""
    ax.set_title(
        f"{table.schedule} p={stages} m={table.num_microbatches}{v}: "
        f"bubble {table.bubble:.2%} (F blue, B green, W red)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
