// The debugger's Ranks panel: in JupyterLab's debugger sidebar, above its Variables, one row
// per rank of the SPMD kernel with its state (running, paused and where, finished), the rank
// whose stop Variables, Call Stack and Source show marked; a click on a paused rank shows that
// rank's stop there instead, and "Pause all" / "Continue all" act on every rank.
//
// The ranks' states are the Ranks sidebar's (sidebar.ts: the kernel's comm, never a poll of
// the ranks). A click asks the kernel with a debug_request `spmdShowRank`: the kernel's relay
// (spmd/kernel/shown.py) answers it by sending JupyterLab the `stopped` event of that rank's
// stop, and JupyterLab's debugger then asks for that rank's stack, scopes and source as for
// any stop. The relay marks each `stopped` event it sends with `spmdRank`, which says which
// rank is shown. Pause and continue are JupyterLab's own (the debugger service's), which the
// relay sends to every rank. The panel is in the debugger's sidebar only while the current
// notebook's kernel is an SPMD kernel.

import { IDebugger } from '@jupyterlab/debugger';
import {
  pauseIcon,
  runIcon,
  Toolbar,
  ToolbarButton
} from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { COLOURS, IRow, RanksPanel } from './sidebar';

// The live panel's states (spmd/magics/cells/panel.py), in a debugger's words.
const WORDS: { [state: string]: string } = {
  busy: 'running',
  straggler: 'running (behind the others)',
  debugger: 'paused',
  input: 'waits at a prompt',
  done: 'finished',
  error: 'raised',
  idle: 'idle',
  dead: 'dead',
  stopped: 'stopped'
};

export class DebuggerRanks extends Widget {
  private _shown: number | null = null; // the rank whose stop JupyterLab shows
  private _says = '';
  private _kernel: unknown = null; // the kernel whose ranks were shown last
  private _drawn = ''; // what the rows showed last (a tick that changed none redraws none)
  // (in the section's header, as the Call Stack's own buttons: always in sight)
  readonly toolbar = new Toolbar();
  private readonly _pauseAll: ToolbarButton;
  private readonly _continueAll: ToolbarButton;

  constructor(
    private readonly _ranks: RanksPanel,
    private readonly _service: IDebugger,
    private readonly _sidebar: IDebugger.ISidebar
  ) {
    super();
    this.id = 'jupyter-spmd-debugger-ranks';
    this.title.label = 'Ranks';
    this.title.caption =
      "The SPMD kernel's ranks: click a paused rank to see its stop in Variables, Call Stack and Source";
    this.addClass('jp-spmd-DebugRanks');
    this._pauseAll = new ToolbarButton({
      icon: pauseIcon,
      label: 'all',
      className: 'jp-spmd-PauseAll',
      tooltip: 'Pause every rank',
      enabled: false,
      onClick: () => void this._service.pause()
    });
    this._continueAll = new ToolbarButton({
      icon: runIcon,
      label: 'all',
      className: 'jp-spmd-ContinueAll',
      tooltip: 'Continue every paused rank',
      enabled: false,
      onClick: () => {
        this._shown = null;
        void this._service.continue();
      }
    });
    this.toolbar.addItem('spmd-pause-all', this._pauseAll);
    this.toolbar.addItem('spmd-continue-all', this._continueAll);
    this.node.addEventListener('click', event => void this._clicked(event));
    _ranks.changed.connect(() => this._update());
    _service.eventMessage.connect((_, event) => {
      const body = (event.body ?? {}) as { spmdRank?: number };
      if (event.event === 'stopped' && typeof body.spmdRank === 'number') {
        this._shown = body.spmdRank;
        this._says = '';
        this._render();
      } else if (event.event === 'continued') {
        this._render();
      }
    });
    this._update();
  }

  /** In the debugger's sidebar (first) for an SPMD kernel, out of it for any other. */
  private _update(): void {
    const wanted = this._ranks.isSpmd;
    if (this._ranks.kernel !== this._kernel) {
      // (another notebook's kernel: its relay shows its own rank, told at its next stop)
      this._kernel = this._ranks.kernel;
      this._shown = null;
      this._says = '';
    }
    if (wanted && !this.parent) {
      this._sidebar.insertWidget(0, this);
    } else if (!wanted && this.parent) {
      this.parent = null;
      this._shown = null;
      this._says = '';
    }
    if (wanted) {
      this._render();
    }
  }

  private _paused(): IRow[] {
    return (this._ranks.state?.ranks ?? []).filter(row => row.state === 'debugger');
  }

  private async _clicked(event: MouseEvent): Promise<void> {
    const target = event.target as HTMLElement;
    const row = target.closest('[data-rank]') as HTMLElement | null;
    const kernel = this._ranks.kernel;
    if (!row || !kernel) {
      return;
    }
    const rank = Number(row.dataset.rank);
    this._says = `Asking for rank ${rank}'s stop...`;
    this._render();
    try {
      const reply = await kernel.requestDebug({
        type: 'request',
        seq: 0,
        command: 'spmdShowRank',
        arguments: { rank }
      }).done;
      const body = reply.content.body as { result?: string } | undefined;
      const said = body?.result ?? String(reply.content.message ?? '');
      this._says = said === `showing rank ${rank}` ? '' : said;
      if (!this._says) {
        this._shown = rank;
      }
    } catch (error) {
      this._says = `The kernel did not answer: ${error}`;
    }
    this._render();
  }

  private _render(): void {
    const node = this.node;
    const state = this._ranks.state;
    if (!state || !state.ranks.length) {
      node.textContent = '';
      this._drawn = '';
      this._pauseAll.enabled = this._continueAll.enabled = false;
      const head = document.createElement('div');
      head.className = 'jp-spmd-DebugRanks-says';
      head.textContent = state ? 'No cluster runs.' : 'Connecting to the kernel...';
      node.appendChild(head);
      return;
    }
    const paused = this._paused();
    const shown = paused.some(row => row.rank === this._shown) ? this._shown : null;
    const running = state.ranks.some(row => row.state === 'busy' || row.state === 'straggler');
    // (the debugger's session follows the focused kernel: a console's may be another one)
    const ours =
      this._service.isStarted &&
      this._service.session?.connection?.kernel?.id === this._ranks.kernel?.id;
    this._pauseAll.enabled = ours && running;
    this._continueAll.enabled = ours && paused.length > 0;
    const drawn = JSON.stringify([
      state.ranks.map(row => [row.rank, row.state, row.line]),
      shown,
      this._says
    ]);
    if (drawn === this._drawn) {
      return; // (only the seconds changed, which this panel does not show: clicks stay)
    }
    this._drawn = drawn;
    node.textContent = '';
    const list = document.createElement('ul');
    list.className = 'jp-spmd-DebugRanks-list';
    list.setAttribute('role', 'listbox');
    list.setAttribute('aria-label', 'Ranks');
    for (const row of state.ranks) {
      const item = document.createElement('li');
      const isPaused = row.state === 'debugger';
      item.setAttribute('role', 'option');
      item.setAttribute('aria-selected', String(row.rank === shown));
      item.className = 'jp-spmd-DebugRanks-rank';
      if (isPaused) {
        item.dataset.rank = String(row.rank);
        item.classList.add('jp-spmd-DebugRanks-paused');
        item.title = `Show rank ${row.rank}'s stop in Variables, Call Stack and Source`;
      }
      if (row.rank === shown) {
        item.classList.add('jp-mod-selected');
      }
      const colour = COLOURS[row.state];
      if (colour) {
        item.style.background = colour;
        item.style.color = '#000';
      }
      const name = document.createElement('span');
      name.className = 'jp-spmd-DebugRanks-name';
      name.textContent = `${row.rank === shown ? '▶' : ' '} rank ${row.rank}`;
      const words = document.createElement('span');
      words.className = 'jp-spmd-DebugRanks-state';
      words.textContent = WORDS[row.state] ?? row.state;
      item.append(name, words);
      if (row.line && (isPaused || row.state === 'busy' || row.state === 'straggler')) {
        const line = document.createElement('div');
        line.className = 'jp-spmd-DebugRanks-line';
        line.textContent = row.line;
        item.appendChild(line);
      }
      list.appendChild(item);
    }
    node.appendChild(list);
    if (this._says) {
      const says = document.createElement('div');
      says.className = 'jp-spmd-DebugRanks-says';
      says.textContent = this._says;
      node.appendChild(says);
    }
  }
}
