// The Ranks sidebar: for a notebook whose kernel is the SPMD kernel, one row per rank (its
// state, host, pid, devices, and the line it is on while a cell runs), the ranks that block
// the others named as it happens, and a rank's stack or log on a click.
//
// The facts come from the kernel over a comm of target "spmd.ranks" (spmd/kernel/sidebar.py):
// the kernel sends the whole state when it changes; this never asks the ranks itself. A
// click asks the kernel with a debug_request (spmdRankStack, spmdRankLog), which the kernel
// answers on its control channel while a cell runs. For any other kernel the sidebar says
// so and does nothing: the magic's own outputs are the same as without it. The debugger's
// Ranks panel (debugger.ts) reads the same state, through `changed`.

import { Kernel, KernelMessage } from '@jupyterlab/services';
import { LabIcon } from '@jupyterlab/ui-components';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

const TARGET = 'spmd.ranks';

// The live panel's colours (spmd/magics/cells/panel.py), by state.
export const COLOURS: { [state: string]: string } = {
  input: '#d0ebff',
  debugger: '#d0ebff',
  busy: '#fff4ce',
  error: '#fde2e1',
  dead: '#fde2e1',
  straggler: '#ffd8a8'
};

const ICON = new LabIcon({
  name: 'jupyter-spmd:ranks',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
    '<rect x="3" y="4" width="18" height="3" rx="1"/><rect x="3" y="10.5" width="18" height="3" rx="1"/>' +
    '<rect x="3" y="17" width="18" height="3" rx="1"/></g></svg>'
});

export interface IRow {
  rank: number;
  state: string;
  seconds: number | null;
  host: string;
  pid: number;
  devices: number | string[];
  line: string;
}

export interface IState {
  cluster: string;
  cell: string;
  ranks: IRow[];
  blocking: number[];
  why: string;
}

export class RanksPanel extends Widget {
  private _kernel: Kernel.IKernelConnection | null = null;
  private _comm: Kernel.IComm | null = null;
  private _state: IState | null = null;
  private _chosen: number | null = null;
  private _shows: 'stack' | 'log' = 'stack';
  private _detail = '';
  private _says = 'Open a notebook.';
  private _spmd = false;
  private _changed = new Signal<RanksPanel, void>(this);

  /** Emitted when the kernel followed, or what it says of its ranks, changes. */
  get changed(): ISignal<RanksPanel, void> {
    return this._changed;
  }

  /** The kernel followed (the current notebook's), and whether it is an SPMD kernel. */
  get kernel(): Kernel.IKernelConnection | null {
    return this._kernel;
  }

  get isSpmd(): boolean {
    return this._spmd;
  }

  /** The kernel's last word on its ranks (null: none yet, or not an SPMD kernel). */
  get state(): IState | null {
    return this._state;
  }

  constructor() {
    super();
    this.id = 'jupyter-spmd-ranks';
    this.title.icon = ICON;
    this.title.caption = 'Ranks';
    this.addClass('jp-spmd-Ranks');
    this.node.addEventListener('click', event => this._clicked(event));
    this._render();
  }

  /** Follow a notebook's kernel: a comm to it when it is an SPMD kernel. */
  async follow(kernel: Kernel.IKernelConnection | null): Promise<void> {
    if (kernel === this._kernel && this._comm && !this._comm.isDisposed) {
      return;
    }
    this._close();
    this._kernel = kernel;
    this._spmd = false;
    this._state = null;
    this._chosen = null;
    this._detail = '';
    if (!kernel) {
      this._says = 'No kernel.';
      this._render();
      return;
    }
    this._says = 'Connecting...';
    this._render();
    const info = await kernel.info;
    if (kernel !== this._kernel) {
      return;
    }
    if (info.implementation !== 'spmd') {
      this._says =
        'Not an SPMD kernel: this sidebar shows the ranks of a notebook that runs the SPMD kernel.';
      this._render();
      return;
    }
    this._spmd = true;
    const comm = kernel.createComm(TARGET);
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => {
      this._state = msg.content.data as unknown as IState;
      this._render();
    };
    comm.onClose = () => {
      if (this._comm === comm) {
        this._comm = null;
      }
    };
    this._comm = comm;
    comm.open({});
  }

  private _close(): void {
    const comm = this._comm;
    this._comm = null;
    if (comm && !comm.isDisposed) {
      try {
        comm.close();
      } catch {
        // (a kernel gone: nothing to close)
      }
    }
  }

  private _clicked(event: MouseEvent): void {
    const target = event.target as HTMLElement;
    const shows = target.closest('[data-shows]') as HTMLElement | null;
    if (shows) {
      this._shows = shows.dataset.shows as 'stack' | 'log';
    } else {
      const row = target.closest('tr[data-rank]') as HTMLElement | null;
      if (!row) {
        return;
      }
      this._chosen = Number(row.dataset.rank);
    }
    void this._ask();
  }

  /** The chosen rank's stack or log, asked of the kernel on its control channel. */
  private async _ask(): Promise<void> {
    const kernel = this._kernel;
    const rank = this._chosen;
    if (!kernel || rank === null) {
      return;
    }
    this._detail = `Asking rank ${rank}...`;
    this._render();
    const command = this._shows === 'stack' ? 'spmdRankStack' : 'spmdRankLog';
    try {
      const reply = await kernel.requestDebug({
        type: 'request',
        seq: 0,
        command,
        arguments: { rank }
      }).done;
      const body = reply.content.body as { result?: string } | undefined;
      this._detail = body?.result ?? '';
    } catch (error) {
      this._detail = `The kernel did not answer: ${error}`;
    }
    this._render();
  }

  private _render(): void {
    this._changed.emit();
    const state = this._state;
    const node = this.node;
    node.textContent = '';
    const head = document.createElement('div');
    head.className = 'jp-spmd-Ranks-head';
    node.appendChild(head);
    if (!state) {
      head.textContent = this._says;
      return;
    }
    if (!state.ranks.length) {
      head.textContent =
        state.cluster === 'starting'
          ? 'The kernel is starting its ranks...'
          : 'No cluster runs: %spmd start (or %spmd restart) starts one.';
      return;
    }
    head.textContent = `${state.cluster}: ${state.cell === 'running' ? 'a cell runs' : 'idle'}`;
    if (state.blocking.length) {
      const blocking = document.createElement('div');
      blocking.className = 'jp-spmd-Ranks-blocking';
      const who =
        state.blocking.length === 1
          ? `Rank ${state.blocking[0]} blocks the others`
          : `Ranks ${state.blocking.join(', ')} block the others`;
      blocking.textContent = `${who}: ${state.why}.`;
      node.appendChild(blocking);
    }
    // (a narrow sidebar: per rank, a line of its state, then where it runs and what it is on)
    const table = document.createElement('table');
    table.className = 'jp-spmd-Ranks-table';
    for (const row of state.ranks) {
      const blocks = state.blocking.includes(row.rank);
      const colour = blocks ? '#ffc9c9' : COLOURS[row.state];
      const devices = Array.isArray(row.devices)
        ? `GPU ${row.devices.join(',')}`
        : `${row.devices} device${row.devices === 1 ? '' : 's'}`;
      const seconds = row.seconds === null ? '' : `${row.seconds.toFixed(1)} s`;
      const lines: [string, string[]][] = [
        ['jp-spmd-Ranks-main', [`rank ${row.rank}`, blocks ? `${row.state} (blocks)` : row.state, seconds]],
        ['jp-spmd-Ranks-where', [`${row.host} · pid ${row.pid} · ${devices}`]]
      ];
      if (row.line) {
        lines.push(['jp-spmd-Ranks-line', [row.line]]);
      }
      for (const [className, texts] of lines) {
        const tr = table.insertRow();
        tr.dataset.rank = String(row.rank);
        tr.className = className;
        if (colour) {
          tr.style.background = colour;
          tr.style.color = '#000';
        }
        if (row.rank === this._chosen) {
          tr.classList.add('jp-spmd-Ranks-chosen');
        }
        for (const text of texts) {
          const td = tr.insertCell();
          td.textContent = text;
          if (texts.length === 1) {
            td.colSpan = 3;
          }
        }
      }
    }
    node.appendChild(table);
    if (this._chosen !== null) {
      const bar = document.createElement('div');
      bar.className = 'jp-spmd-Ranks-bar';
      bar.textContent = `Rank ${this._chosen}: `;
      for (const shows of ['stack', 'log']) {
        const button = document.createElement('button');
        button.dataset.shows = shows;
        button.textContent = shows;
        button.className = shows === this._shows ? 'jp-mod-active' : '';
        bar.appendChild(button);
      }
      node.appendChild(bar);
      const pre = document.createElement('pre');
      pre.className = 'jp-spmd-Ranks-detail';
      pre.textContent = this._detail;
      node.appendChild(pre);
    }
  }
}

