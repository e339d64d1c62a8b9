// The per-rank data of a cell (application/vnd.spmd.ranks+json, spmd/magics/cells/cell.py):
// for programs that read a notebook, not for people, who read the grouped outputs beside it.
// Its renderer shows nothing, and the output that holds it takes no room.

import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Widget } from '@lumino/widgets';

export const RANKS_DATA = 'application/vnd.spmd.ranks+json';

class Hidden extends Widget implements IRenderMime.IRenderer {
  constructor() {
    super();
    this.addClass('jp-spmd-RanksData');
  }

  renderModel(): Promise<void> {
    return Promise.resolve();
  }
}

export const ranksDataFactory: IRenderMime.IRendererFactory = {
  safe: true,
  mimeTypes: [RANKS_DATA],
  createRenderer: () => new Hidden()
};
