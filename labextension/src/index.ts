// A left-sidebar panel that belongs to no kernel: it polls the Jupyter server
// extension (eventsched/jupyter/server_ext.py), which asks the daemon as the
// user who runs Jupyter.
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Notification } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import { URLExt } from '@jupyterlab/coreutils';
import { listIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

const POLL_MS = 2000;

interface Gpu {
  id: number;
  node: string;
  allocated: number;
  utilization: number | null;
  memory_used_mib: number;
  memory_total_mib: number;
  marks: string[]; // drained or paused, over memory request, idle
}

interface Job {
  id: number;
  name: string;
  user: string;
  state: string;
  gpus: number;
  reason: string | null;
  forecast?: string;
  note?: string; // a running job: over its memory request, idle
  exit_reason: string;
  exit_code: number | null;
}

interface State {
  ok?: boolean;
  message?: string;
  user: string;
  gpus: Gpu[];
  jobs: Job[];
  ended: Job[];
}

async function call(path: string, method = 'GET'): Promise<any> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'eventsched', path);
  const reply = await ServerConnection.makeRequest(url, { method }, settings);
  if (!reply.ok) {
    return { ok: false, message: `${reply.status} ${reply.statusText}` };
  }
  return reply.json();
}

function el(tag: string, cls: string, text = ''): HTMLElement {
  const node = document.createElement(tag);
  node.className = cls;
  node.textContent = text;
  return node;
}

// why a job ended, unless its state already says it all
function endReason(job: Job): string {
  const why = job.exit_reason || (job.exit_code ? `exit code ${job.exit_code}` : '');
  return why === job.state ? '' : why;
}

class Sidebar extends Widget {
  private notes = new Map<number, string>(); // a row's last action result, one line
  private explained = new Map<number, string>(); // explain's text or the output's tail, shown under the row
  private seenEnds: Set<number> | null = null; // ends already known when the page loaded
  private wasRunning = new Set<number>(); // the user's jobs running at the last poll
  private timer = 0;

  constructor() {
    super();
    this.id = 'eventsched-sidebar';
    this.addClass('eventsched-sidebar');
    this.title.caption = 'eventsched: GPUs and jobs';
    this.title.icon = listIcon;
  }

  start(): void {
    const tick = async () => {
      try {
        this.render(await call('state'));
      } catch (err) {
        this.render({ ok: false, message: String(err) } as State);
      }
      this.timer = window.setTimeout(tick, POLL_MS);
    };
    void tick();
  }

  dispose(): void {
    window.clearTimeout(this.timer);
    super.dispose();
  }

  private notify(state: State): void {
    // a job of the user's stopped and put back in the queue: preempted, over its memory, its GPUs booked
    const mine = state.jobs.filter(j => j.user === state.user);
    for (const job of mine) {
      if (this.wasRunning.has(job.id) && (job.state === 'queued' || job.state === 'held')) {
        const why = job.exit_reason ? `: ${job.exit_reason}` : '';
        Notification.emit(`eventsched: job ${job.id} (${job.name}) stopped and requeued${why}`, 'warning',
          { autoClose: 15000 });
      }
    }
    this.wasRunning = new Set(mine.filter(j => j.state === 'running').map(j => j.id));
    const ended = state.ended.filter(j => j.user === state.user);
    if (this.seenEnds === null) {
      this.seenEnds = new Set(ended.map(j => j.id));
      return;
    }
    for (const job of ended) {
      if (this.seenEnds.has(job.id)) {
        continue;
      }
      this.seenEnds.add(job.id);
      const why = endReason(job);
      const text = `eventsched: job ${job.id} (${job.name}) ${job.state}${why ? `: ${why}` : ''}`;
      const type = job.state === 'succeeded' ? 'success' : job.state === 'cancelled' ? 'info' : 'error';
      Notification.emit(text, type, { autoClose: 15000 });
    }
  }

  private render(state: State): void {
    const root = el('div', 'es-side');
    if (state.ok === false) {
      root.appendChild(el('div', 'es-side-error', state.message || 'no answer'));
      this.node.replaceChildren(root);
      return;
    }
    this.notify(state);
    root.appendChild(el('h3', '', 'GPUs'));
    const nodes = [...new Set(state.gpus.map(g => g.node))];
    for (const node of nodes) {
      if (nodes.length > 1) {
        root.appendChild(el('div', 'es-side-node', `node ${node}`));
      }
      for (const g of state.gpus.filter(x => x.node === node)) {
        const row = el('div', 'es-side-gpu');
        row.dataset.gpu = `${g.node}:${g.id}`;
        const mem = `${(g.memory_used_mib / 1024).toFixed(1)}/${(g.memory_total_mib / 1024).toFixed(0)} GiB`;
        const use = g.utilization === null ? '-' : `${Math.round(g.utilization)}%`;
        row.textContent = `GPU ${g.id} · alloc ${g.allocated.toFixed(2)} · use ${use} · ${mem}`;
        for (const mark of g.marks || []) {
          row.appendChild(el('span', 'es-side-mark', mark));
        }
        root.appendChild(row);
      }
    }
    const queued = state.jobs.filter(j => j.state !== 'running');
    const running = state.jobs.filter(j => j.state === 'running');
    this.table(root, 'Queue', queued, j => `${j.reason || ''}${j.forecast ? ` · starts in ${j.forecast}` : ''}`);
    this.table(root, 'Running', running, j => j.note || '');
    this.table(root, 'Recent ends', state.ended, endReason);
    this.node.replaceChildren(root);
  }

  private table(root: HTMLElement, title: string, jobs: Job[], detail: (j: Job) => string): void {
    root.appendChild(el('h3', '', `${title} (${jobs.length})`));
    const list = el('div', 'es-side-jobs');
    for (const job of jobs) {
      const row = el('div', 'es-side-job');
      row.dataset.job = String(job.id);
      row.dataset.state = job.state;
      row.appendChild(el('div', 'es-side-head', `${job.id} ${job.name} · ${job.user} · ${job.gpus} GPU · ${job.state}`));
      const more = detail(job);
      if (more) {
        row.appendChild(el('div', 'es-side-detail', more));
      }
      const buttons = el('div', 'es-side-actions');
      const waiting = job.state === 'queued' || job.state === 'held';
      const actions = waiting || job.state === 'running'
        ? ['cancel', job.state === 'held' ? 'release' : 'hold', 'explain'] : ['explain'];
      if (!waiting) {
        actions.push('output'); // it has run: it has an output
      }
      for (const action of actions) {
        const button = el('button', `jp-Button es-side-${action}`, action) as HTMLButtonElement;
        button.onclick = () => void this.act(job.id, action);
        buttons.appendChild(button);
      }
      row.appendChild(buttons);
      const note = this.notes.get(job.id);
      if (note) {
        row.appendChild(el('div', 'es-side-note', note));
      }
      const text = this.explained.get(job.id);
      if (text) {
        row.appendChild(el('pre', 'es-side-explain', text));
      }
      list.appendChild(row);
    }
    root.appendChild(list);
  }

  private async act(job: number, action: string): Promise<void> {
    const shows = action === 'explain' || action === 'output';
    if (shows && this.explained.has(job)) {
      this.explained.delete(job); // a second click hides it
      return;
    }
    const reply = shows
      ? await call(`jobs/${job}/${action}`)
      : await call(`jobs/${job}/${action}`, 'POST');
    if (shows && reply.ok) {
      this.explained.set(job, reply.text);
    } else {
      this.notes.set(job, reply.message);
    }
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'eventsched-jupyterlab:sidebar',
  description: 'GPUs, queue, running jobs and recent ends of the eventsched daemon, with actions',
  autoStart: true,
  activate: (app: JupyterFrontEnd) => {
    const sidebar = new Sidebar();
    app.shell.add(sidebar, 'left', { rank: 900 });
    sidebar.start();
  }
};

export default plugin;
