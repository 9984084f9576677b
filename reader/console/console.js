// ds3 console: lists buckets and streams, shows a stream's metadata, tails it over SSE and
// shows a few metrics. Only the public protocol (plus GET /ds3/streams and /ds3/buckets).
// Everything that comes from the server reaches the DOM through textContent / attributes,
// never innerHTML.
'use strict';

(() => {
  // The page is served at <base>/console/: the API is at <base>/.
  const BASE = location.pathname.replace(/\/console(\/[^/]*)?$/, '');
  const TOKEN_KEY = 'ds3.console.token';
  const PAGE = 100; // listing page size
  const MAX_LOG = 500; // messages kept in the DOM
  const METRICS_EVERY_MS = 5000;
  const RECONNECT_MS = 1000;

  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ small helpers
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  function showError(text) {
    const p = $('error');
    p.textContent = text || '';
    p.hidden = !text;
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || '';
  }

  function authHeaders() {
    const t = token();
    return t ? { Authorization: 'Bearer ' + t } : {};
  }

  async function api(path, init) {
    const opts = init || {};
    return fetch(BASE + path, {
      ...opts,
      cache: 'no-store',
      headers: { ...authHeaders(), ...(opts.headers || {}) },
    });
  }

  async function failure(resp) {
    let text = '';
    try { text = (await resp.text()).trim().slice(0, 300); } catch (_e) { /* ignore */ }
    return 'HTTP ' + resp.status + (text ? ': ' + text : '');
  }

  function mediaType(ct) {
    return (ct || '').split(';')[0].trim().toLowerCase();
  }

  function isTextForSse(ct) {
    const mt = mediaType(ct);
    return mt.startsWith('text/') || mt === 'application/json';
  }

  function fmtBytes(n) {
    if (typeof n !== 'number') return '';
    if (n < 1024) return n + ' B';
    if (n < 1024 * 1024) return (n / 1024).toFixed(1) + ' KiB';
    return (n / 1024 / 1024).toFixed(1) + ' MiB';
  }

  // ------------------------------------------------------------------ token
  function showTokenState() {
    $('token-state').textContent = token()
      ? 'token set (kept in this tab only; sent as Authorization)'
      : 'no token: public reads only';
  }

  $('token-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const t = $('token').value.trim();
    if (t) sessionStorage.setItem(TOKEN_KEY, t);
    else sessionStorage.removeItem(TOKEN_KEY);
    $('token').value = '';
    showTokenState();
    refreshAll();
  });

  $('token-clear').addEventListener('click', () => {
    sessionStorage.removeItem(TOKEN_KEY);
    $('token').value = '';
    showTokenState();
    refreshAll();
  });

  // ------------------------------------------------------------------ listings
  // scope: null for plain streams (/ds3/streams), else a bucket id (/v1/buckets/{id}/streams)
  const listing = { scope: null, after: null, bucketsAfter: null };

  async function loadBuckets(more) {
    const list = $('bucket-list');
    if (!more) {
      clear(list);
      listing.bucketsAfter = null;
      const plain = el('li');
      const b = el('button', 'plain streams (/v1/stream/)');
      b.type = 'button';
      b.dataset.bucket = '';
      b.addEventListener('click', () => selectScope(null));
      plain.appendChild(b);
      list.appendChild(plain);
    }
    const q = new URLSearchParams({ limit: String(PAGE) });
    if (listing.bucketsAfter) q.set('after', listing.bucketsAfter);
    const resp = await api('/ds3/buckets?' + q);
    if (!resp.ok) {
      showError('listing buckets: ' + await failure(resp));
      return;
    }
    const page = await resp.json();
    for (const bucket of page.buckets || []) {
      const li = el('li');
      const b = el('button', bucket.bucket_id);
      b.type = 'button';
      b.dataset.bucket = bucket.bucket_id;
      b.appendChild(el('small', bucket.streams + ' stream(s)'));
      b.addEventListener('click', () => selectScope(bucket.bucket_id));
      li.appendChild(b);
      list.appendChild(li);
    }
    listing.bucketsAfter = page.has_more ? page.next_cursor : null;
    $('buckets-more').hidden = !page.has_more;
    markScope();
  }

  function markScope() {
    for (const b of $('bucket-list').querySelectorAll('button')) {
      b.classList.toggle('current', (b.dataset.bucket || null) === listing.scope);
    }
  }

  function selectScope(bucket) {
    listing.scope = bucket;
    $('prefix').value = '';
    markScope();
    loadStreams(false);
  }

  function streamUrl(entry) {
    if (listing.scope === null) return entry.url;
    return '/v1/buckets/' + encodeURIComponent(listing.scope) + '/' + encodeURIComponent(entry.stream_id);
  }

  async function loadStreams(more) {
    const list = $('stream-list');
    if (!more) {
      clear(list);
      listing.after = null;
    }
    $('streams-title').textContent = listing.scope === null
      ? 'Streams' : 'Streams in bucket ' + listing.scope;
    const q = new URLSearchParams({ limit: String(PAGE) });
    const prefix = $('prefix').value;
    if (prefix) q.set('prefix', prefix);
    if (listing.after) q.set('after', listing.after);
    const path = listing.scope === null
      ? '/ds3/streams?' + q
      : '/v1/buckets/' + encodeURIComponent(listing.scope) + '/streams?' + q;
    const resp = await api(path);
    if (!resp.ok) {
      showError('listing streams: ' + await failure(resp));
      return;
    }
    const page = await resp.json();
    for (const s of page.streams || []) {
      const url = streamUrl(s);
      const name = listing.scope === null ? s.path : s.stream_id;
      const li = el('li');
      const b = el('button', name);
      b.type = 'button';
      b.setAttribute('data-url', url);
      b.appendChild(el('small', [s.content_type, s.status, fmtBytes(s.tail_offset)].join(' · ')));
      b.addEventListener('click', () => openStream(url, name));
      li.appendChild(b);
      list.appendChild(li);
    }
    listing.after = page.has_more ? page.next_cursor : null;
    $('streams-more').hidden = !page.has_more;
    $('streams-empty').hidden = list.childElementCount > 0;
    markCurrentStream();
  }

  $('filter-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    loadStreams(false);
  });
  $('streams-more').addEventListener('click', () => loadStreams(true));
  $('buckets-more').addEventListener('click', () => loadBuckets(true));

  // ------------------------------------------------------------------ one stream
  const tail = {
    url: null, // the stream's URL path (percent-encoded)
    contentType: '',
    snapshotOffset: null,
    gen: 0, // bumped by every (re)start: stale connections stop themselves
    stop: null, // closes the current connection
    offset: null, // where to go on from (the last control event's streamNextOffset)
    closed: false,
    failed: null, // why the server refused the tail (no retry)
    count: 0,
    timer: null,
  };

  function markCurrentStream() {
    for (const b of $('stream-list').querySelectorAll('button[data-url]')) {
      b.classList.toggle('current', b.getAttribute('data-url') === tail.url);
    }
  }

  function setMeta(id, value) {
    $(id).textContent = value === null || value === undefined ? '-' : value;
  }

  async function openStream(url, label) {
    stopTail();
    tail.url = url;
    if (location.hash !== '#' + url) history.replaceState(null, '', '#' + url);
    $('stream').hidden = false;
    $('stream-title').textContent = label || safeDecode(url);
    clear($('log'));
    tail.count = 0;
    $('log-count').textContent = '0';
    markCurrentStream();
    if (await loadMeta()) startTail();
  }

  function safeDecode(text) {
    try { return decodeURIComponent(text); } catch (_e) { return text; }
  }

  async function loadMeta() {
    const resp = await api(tail.url, { method: 'HEAD' });
    if (!resp.ok) {
      setLive('HEAD: HTTP ' + resp.status + (resp.status === 401 || resp.status === 403
        ? ' (this stream needs a token with read scope)' : ''));
      for (const id of ['meta-content-type', 'meta-next-offset', 'meta-closed', 'meta-ttl',
        'meta-expires-at', 'meta-snapshot-offset']) setMeta(id, null);
      return false;
    }
    const h = resp.headers;
    tail.contentType = h.get('Content-Type') || '';
    tail.snapshotOffset = h.get('Stream-Snapshot-Offset');
    setMeta('meta-content-type', tail.contentType);
    setMeta('meta-next-offset', h.get('Stream-Next-Offset'));
    setMeta('meta-closed', h.get('Stream-Closed') || 'false');
    setMeta('meta-ttl', h.get('Stream-TTL'));
    setMeta('meta-expires-at', h.get('Stream-Expires-At'));
    setMeta('meta-snapshot-offset', tail.snapshotOffset);
    return true;
  }

  function setLive(text, live) {
    const s = $('live-state');
    s.textContent = text;
    s.classList.toggle('live', !!live);
  }

  function stopTail() {
    tail.gen += 1;
    if (tail.stop) tail.stop();
    tail.stop = null;
    if (tail.timer) clearTimeout(tail.timer);
    tail.timer = null;
  }

  function startTail() {
    stopTail();
    tail.closed = false;
    tail.failed = null;
    const from = $('from').value;
    // From the beginning: the snapshot's offset when there is one (earlier reads are 410).
    tail.offset = from === 'now' ? 'now' : (tail.snapshotOffset || '-1');
    connect(tail.gen);
  }

  function connect(gen) {
    if (gen !== tail.gen) return;
    const url = BASE + tail.url + '?offset=' + encodeURIComponent(tail.offset) + '&live=sse';
    const binary = !isTextForSse(tail.contentType);
    const handlers = {
      data: (data, base64) => showData(data, base64 || binary),
      control: (data) => onControl(data),
      end: (why) => onEnd(gen, why),
    };
    // EventSource cannot send an Authorization header: with a token, read the event
    // stream with fetch and parse it here.
    if (token()) {
      setLive('connecting (fetch, with token)…');
      sseByFetch(url, gen, handlers);
    } else {
      setLive('connecting (EventSource)…');
      sseByEventSource(url, gen, handlers);
    }
  }

  function sseByEventSource(url, gen, handlers) {
    const es = new EventSource(url);
    tail.stop = () => es.close();
    es.addEventListener('open', () => { if (gen === tail.gen) setLive('live (EventSource)', true); });
    es.addEventListener('data', (e) => { if (gen === tail.gen) handlers.data(e.data, false); });
    es.addEventListener('control', (e) => { if (gen === tail.gen) handlers.control(e.data); });
    // The server ends every SSE response after a while; EventSource would reconnect with
    // the first URL (replaying everything), so reconnect ourselves from the last offset.
    es.addEventListener('error', () => {
      es.close();
      handlers.end('the connection ended');
    });
  }

  async function sseByFetch(url, gen, handlers) {
    const ctrl = new AbortController();
    tail.stop = () => ctrl.abort();
    let why = 'the connection ended';
    try {
      const resp = await fetch(url, {
        headers: { ...authHeaders(), Accept: 'text/event-stream' },
        cache: 'no-store',
        signal: ctrl.signal,
      });
      if (!resp.ok) {
        why = await failure(resp);
        if (resp.status >= 400 && resp.status < 500 && resp.status !== 429) tail.failed = why;
        return;
      }
      if (gen === tail.gen) setLive('live (fetch, with token)', true);
      const base64 = resp.headers.get('Stream-SSE-Data-Encoding') === 'base64';
      await parseSse(resp.body, (type, data) => {
        if (gen !== tail.gen) return;
        if (type === 'data') handlers.data(data, base64);
        else if (type === 'control') handlers.control(data);
      });
    } catch (e) {
      if (e && e.name === 'AbortError') return;
      why = String(e && e.message ? e.message : e);
    } finally {
      if (!ctrl.signal.aborted) handlers.end(why);
    }
  }

  // text/event-stream (the WHATWG parsing rules, for the fields used here: event, data).
  async function parseSse(body, dispatch) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    let type = '';
    let data = [];
    const line = (text) => {
      if (text === '') {
        if (data.length) dispatch(type || 'message', data.join('\n'));
        type = '';
        data = [];
        return;
      }
      if (text.startsWith(':')) return;
      const i = text.indexOf(':');
      const field = i < 0 ? text : text.slice(0, i);
      let value = i < 0 ? '' : text.slice(i + 1);
      if (value.startsWith(' ')) value = value.slice(1);
      if (field === 'event') type = value;
      else if (field === 'data') data.push(value);
    };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value;
      for (;;) {
        const m = /\r\n|\r|\n/.exec(buf);
        if (m === null) break;
        if (m[0] === '\r' && m.index === buf.length - 1) break; // maybe a CRLF cut in two
        line(buf.slice(0, m.index));
        buf = buf.slice(m.index + m[0].length);
      }
    }
  }

  function onControl(text) {
    let c;
    try { c = JSON.parse(text); } catch (_e) { return; }
    if (typeof c.streamNextOffset === 'string') {
      tail.offset = c.streamNextOffset;
      $('live-offset').textContent = c.streamNextOffset;
      if (c.upToDate) setMeta('meta-next-offset', c.streamNextOffset); // the tail, as HEAD would say
    }
    if (c.streamClosed) {
      tail.closed = true;
      setMeta('meta-closed', 'true');
    }
  }

  function onEnd(gen, why) {
    if (gen !== tail.gen) return;
    tail.stop = null;
    if (tail.failed) {
      setLive('stopped: ' + tail.failed);
      return;
    }
    if (tail.closed) {
      setLive('stream closed: no more data');
      return;
    }
    setLive('reconnecting (' + why + ')…');
    tail.timer = setTimeout(async () => {
      // EventSource does not say why it failed: a stream that is gone stops the tail here.
      if (gen === tail.gen && await loadMeta()) connect(gen);
    }, RECONNECT_MS);
  }

  function addEntry(text, cls) {
    const log = $('log');
    const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.appendChild(el('li', text, cls));
    while (log.childElementCount > MAX_LOG) log.removeChild(log.firstChild);
    if (atBottom) log.scrollTop = log.scrollHeight;
  }

  function showData(data, base64) {
    let entries;
    if (base64) {
      entries = [describeBinary(data)];
    } else if (mediaType(tail.contentType) === 'application/json') {
      // a JSON stream's data event is one array of the messages
      try {
        const v = JSON.parse(data);
        entries = Array.isArray(v) ? v.map((x) => JSON.stringify(x)) : [JSON.stringify(v)];
      } catch (_e) {
        entries = [data];
      }
    } else {
      entries = [data];
    }
    for (const e of entries) addEntry(e);
    tail.count += entries.length;
    $('log-count').textContent = String(tail.count);
  }

  function describeBinary(b64) {
    let bytes;
    try { bytes = atob(b64.replace(/\s+/g, '')); } catch (_e) { return '(undecodable base64) ' + b64.slice(0, 200); }
    const n = bytes.length;
    let hex = '';
    let text = '';
    for (let i = 0; i < Math.min(n, 48); i++) {
      const c = bytes.charCodeAt(i);
      hex += c.toString(16).padStart(2, '0') + ' ';
      text += c >= 0x20 && c < 0x7f ? bytes[i] : '.';
    }
    return n + ' bytes: ' + hex.trim() + (n > 48 ? ' …' : '') + '  |' + text + '|';
  }

  $('retail').addEventListener('click', async () => {
    if (!tail.url) return;
    clear($('log'));
    tail.count = 0;
    $('log-count').textContent = '0';
    if (await loadMeta()) startTail();
  });
  $('stop').addEventListener('click', () => {
    stopTail();
    setLive('stopped');
  });
  $('from').addEventListener('change', () => $('retail').click());

  // ------------------------------------------------------------------ metrics
  // Read whatever /metrics exposes (names change as it evolves): a few highlights found by
  // pattern, summed over labels, and every ds3_* family.
  const HIGHLIGHTS = [
    ['HTTP requests', /^ds3_(http_)?requests(_total)?$/],
    ['HTTP 5xx responses', /^ds3_(http_)?requests(_total)?$/, (l) => /^5/.test(l.status || l.code || '')],
    ['Sealed reads (from the store)', /^ds3_reader_sealed_(responses|reads)(_total)?$/],
    ['Requests forwarded', /^ds3_reader_forwarded(_requests)?(_total)?$/],
    ['Upstream requests (ingester)', /^ds3_reader_ingester_requests(_total)?$/],
    ['Collapsed waits', /^ds3_reader_collapsed(_waits|_requests)?(_total)?$/],
    ['Descriptor cache hits', /^ds3_reader_.*cache_hits(_total)?$/],
    ['Live connections', /^ds3_.*live_connections$/],
    ['SSE clients', /^ds3_reader_sse_clients$/],
    ['SSE upstream subscriptions', /^ds3_reader_sse_upstreams?$/],
    ['Object store errors', /^ds3_(object_store|s3)_errors(_total)?$/],
    ['Slow clients dropped', /^ds3_.*slow_clients_dropped(_total)?$/],
  ];

  function parseLabels(text) {
    const out = {};
    const re = /([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
    let m;
    while ((m = re.exec(text)) !== null) out[m[1]] = m[2];
    return out;
  }

  function parseMetrics(text) {
    const families = new Map();
    for (const raw of text.split('\n')) {
      const line = raw.trim();
      if (!line || line.startsWith('#')) continue;
      const m = /^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
      if (!m) continue;
      const value = Number(m[3]);
      if (!Number.isFinite(value)) continue;
      if (!families.has(m[1])) families.set(m[1], []);
      families.get(m[1]).push({ labels: parseLabels(m[2] || ''), value });
    }
    return families;
  }

  function fmtNumber(v) {
    return Number.isInteger(v) ? String(v) : v.toFixed(3);
  }

  function row(name, value) {
    const tr = el('tr');
    tr.appendChild(el('th', name));
    tr.appendChild(el('td', value));
    return tr;
  }

  async function loadMetrics() {
    let families;
    try {
      const resp = await api('/metrics');
      if (!resp.ok) {
        $('metrics-state').textContent = '(unavailable: HTTP ' + resp.status + ')';
        return;
      }
      families = parseMetrics(await resp.text());
    } catch (e) {
      $('metrics-state').textContent = '(unavailable)';
      return;
    }
    $('metrics-state').textContent = '(' + new Date().toLocaleTimeString() + ')';
    const hl = $('metrics-highlights');
    clear(hl);
    for (const [label, pattern, filter] of HIGHLIGHTS) {
      let total = null;
      for (const [name, series] of families) {
        if (!pattern.test(name)) continue;
        for (const s of series) {
          if (filter && !filter(s.labels)) continue;
          total = (total || 0) + s.value;
        }
        if (total === null && filter) total = 0; // the family exists: none matched
        break;
      }
      hl.appendChild(row(label, total === null ? '-' : fmtNumber(total)));
    }
    const all = $('metrics-all');
    clear(all);
    for (const name of [...families.keys()].sort()) {
      if (!name.startsWith('ds3_') || /_(bucket|created)$/.test(name)) continue;
      const series = families.get(name);
      const sum = series.reduce((a, s) => a + s.value, 0);
      all.appendChild(row(name + (series.length > 1 ? ' (' + series.length + ' series)' : ''), fmtNumber(sum)));
    }
  }

  // ------------------------------------------------------------------ start
  async function refreshAll() {
    showError('');
    await Promise.all([loadBuckets(false), loadStreams(false), loadMetrics()]);
    if (tail.url) {
      const url = tail.url;
      tail.url = null;
      await openStream(url, $('stream-title').textContent);
    }
  }

  showTokenState();
  refreshAll().then(() => {
    const h = location.hash.slice(1);
    if (h.startsWith('/v1/') && !tail.url) openStream(h);
  });
  setInterval(() => { if (!document.hidden) loadMetrics(); }, METRICS_EVERY_MS);
})();
