// jupyter-spmd's JupyterLab extension: the Ranks sidebar (sidebar.ts) and, where JupyterLab's
// debugger is there, the Ranks panel in the debugger's sidebar (debugger.ts). Both follow the
// current notebook's kernel, and show nothing of their own for a kernel that is not an SPMD
// kernel. And a renderer that hides a cell's per-rank data (ranksdata.ts).

import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { IDebugger, IDebuggerSidebar } from '@jupyterlab/debugger';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';

import { DebuggerRanks } from './debugger';
import { ranksDataFactory } from './ranksdata';
import { RanksPanel } from './sidebar';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-spmd:ranks',
  description: "The SPMD kernel's Ranks sidebar, and its Ranks panel in the debugger.",
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IDebugger, IDebuggerSidebar, IRenderMimeRegistry],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    service: IDebugger | null,
    debuggerSidebar: IDebugger.ISidebar | null,
    rendermime: IRenderMimeRegistry | null
  ) => {
    // (first: preferred to the empty text/plain beside it)
    rendermime?.addFactory(ranksDataFactory, 0);
    const panel = new RanksPanel();
    app.shell.add(panel, 'right', { rank: 900 });
    if (service && debuggerSidebar) {
      new DebuggerRanks(panel, service, debuggerSidebar);
    }
    const watched = new WeakSet<NotebookPanel>();
    const watch = (notebook: NotebookPanel | null) => {
      if (!notebook) {
        void panel.follow(null);
        return;
      }
      const context = notebook.sessionContext;
      const follow = () => void panel.follow(context.session?.kernel ?? null);
      if (watched.has(notebook)) {
        follow();
        return;
      }
      watched.add(notebook);
      context.kernelChanged.connect(() => {
        if (tracker.currentWidget === notebook) {
          follow();
        }
      });
      context.statusChanged.connect((_, status) => {
        if (status === 'idle' && tracker.currentWidget === notebook) {
          follow(); // (after a restart: a new comm)
        }
      });
      void context.ready.then(() => {
        if (tracker.currentWidget === notebook) {
          follow();
        }
      });
    };
    tracker.currentChanged.connect((_, notebook) => watch(notebook));
    watch(tracker.currentWidget);
  }
};

export default plugin;
