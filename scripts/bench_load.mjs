// Load generator for scripts/bench (driven by scripts/bench_run.py; no npm dependencies).
//
//   node bench_load.mjs throughput --url BASE --writers 32 --layout per-writer|shared
//                                  [--size 100] [--warmup 1] [--duration 10] [--prefix NAME] [--client raw|http]
//                                  [--token T]   (every request: Authorization: Bearer T)
//   node bench_load.mjs latency    --url BASE [--rate 200] [--samples 1000] [--warmup 1] [--size 100]
//                                  [--prefix NAME] [--client raw|http]
//   node bench_load.mjs sink       --port P     # trivial server: 204 to every request (load-generator ceiling)
//
// stdout protocol: "MARK start" / "MARK end" bracket the measured window (the orchestrator samples CPU
// times when it reads them), and the last line is one JSON object with the results. Streams are
// created with PUT (application/octet-stream) under BASE + "/v1/stream/".
//
// Two HTTP/1.1 clients: "raw" (a minimal keep-alive client on node:net, one connection per writer; the
// default because it costs the least CPU per request on a machine shared with the server) and
// "http" (node:http with a keep-alive Agent, maxSockets 32).
import http from "node:http"
import net from "node:net"
import { performance } from "node:perf_hooks"

const CT = "application/octet-stream"

function parseArgs(argv) {
  const opts = { _: [] }
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]
    if (a.startsWith("--")) {
      const key = a.slice(2)
      const next = argv[i + 1]
      if (next === undefined || next.startsWith("--")) opts[key] = true
      else {
        opts[key] = next
        i++
      }
    } else opts._.push(a)
  }
  return opts
}

// ---------------------------------------------------------------------------------------------
// Minimal HTTP/1.1 keep-alive client over one TCP connection (one request in flight at a time).

class RawConn {
  constructor(host, port) {
    this.hostHeader = `${host}:${port}`
    this.buf = null
    this.pending = null
    this.dead = false
    this.sock = net.connect({ host, port })
    this.sock.setNoDelay(true)
    this.sock.on("data", (d) => this.onData(d))
    this.sock.on("error", (e) => this.fail(e))
    this.sock.on("close", () => this.fail(new Error("connection closed")))
  }

  fail(err) {
    this.dead = true
    const p = this.pending
    this.pending = null
    if (p) p.reject(err)
  }

  request(method, path, headers, body) {
    if (this.dead) return Promise.reject(new Error("connection is closed"))
    let head = `${method} ${path} HTTP/1.1\r\nHost: ${this.hostHeader}\r\n`
    for (const k in headers) head += `${k}: ${headers[k]}\r\n`
    if (body) head += `Content-Length: ${body.length}\r\n\r\n`
    else head += method === "GET" || method === "HEAD" ? "\r\n" : "Content-Length: 0\r\n\r\n"
    return new Promise((resolve, reject) => {
      this.pending = { resolve, reject, method, state: 0, status: 0, headers: null, mode: 0, need: 0, chunks: [] }
      this.sock.write(body ? Buffer.concat([Buffer.from(head, "latin1"), body]) : head)
    })
  }

  onData(d) {
    this.buf = this.buf && this.buf.length ? Buffer.concat([this.buf, d]) : d
    const p = this.pending
    if (!p) return
    // state 0: headers; 1: fixed-length body; 2: chunk-size line; 3: chunk data; 4: trailers
    for (;;) {
      const buf = this.buf
      if (p.state === 0) {
        const idx = buf.indexOf("\r\n\r\n")
        if (idx < 0) return
        const lines = buf.toString("latin1", 0, idx).split("\r\n")
        p.status = Number(lines[0].split(" ", 2)[1])
        const h = {}
        for (let i = 1; i < lines.length; i++) {
          const c = lines[i].indexOf(":")
          h[lines[i].slice(0, c).trim().toLowerCase()] = lines[i].slice(c + 1).trim()
        }
        p.headers = h
        this.buf = buf.subarray(idx + 4)
        if (p.method === "HEAD" || p.status === 204 || p.status === 304 || p.status < 200) return this.done()
        if ((h["transfer-encoding"] || "").toLowerCase().includes("chunked")) p.state = 2
        else {
          p.need = Number(h["content-length"] || 0)
          p.state = 1
        }
      } else if (p.state === 1) {
        if (buf.length < p.need) return
        p.chunks.push(buf.subarray(0, p.need))
        this.buf = buf.subarray(p.need)
        return this.done()
      } else if (p.state === 2) {
        const idx = buf.indexOf("\r\n")
        if (idx < 0) return
        p.need = parseInt(buf.toString("latin1", 0, idx), 16)
        this.buf = buf.subarray(idx + 2)
        p.state = p.need === 0 ? 4 : 3
      } else if (p.state === 3) {
        if (buf.length < p.need + 2) return
        p.chunks.push(buf.subarray(0, p.need))
        this.buf = buf.subarray(p.need + 2)
        p.state = 2
      } else {
        const idx = buf.indexOf("\r\n")
        if (idx < 0) return
        this.buf = buf.subarray(idx + 2)
        if (idx === 0) return this.done()
      }
    }
  }

  done() {
    const p = this.pending
    this.pending = null
    if ((p.headers.connection || "").toLowerCase() === "close") {
      this.dead = true
      this.sock.destroy()
    }
    p.resolve({ status: p.status, headers: p.headers, body: p.chunks.length === 1 ? p.chunks[0] : Buffer.concat(p.chunks) })
  }

  close() {
    this.dead = true
    this.sock.destroy()
  }
}

// A client: request(method, path, headers, body) -> {status, headers (lower-case), body: Buffer}.
// "raw" keeps a pool of RawConn (one request per connection at a time); "http" uses node:http.
function makeClient(kind, base) {
  const u = new URL(base)
  const host = u.hostname
  const port = Number(u.port || 80)
  if (kind === "http") {
    const agent = new http.Agent({ keepAlive: true, maxSockets: 32 })
    return {
      request(method, path, headers, body) {
        return new Promise((resolve, reject) => {
          const h = { ...headers }
          if (body) h["Content-Length"] = body.length
          const req = http.request({ host, port, method, path, headers: h, agent }, (res) => {
            const chunks = []
            res.on("data", (c) => chunks.push(c))
            res.on("end", () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(chunks) }))
            res.on("error", reject)
          })
          req.on("error", reject)
          req.end(body)
        })
      },
      close() {
        agent.destroy()
      },
    }
  }
  const idle = []
  const all = new Set()
  return {
    async request(method, path, headers, body) {
      let c
      while (idle.length) {
        c = idle.pop()
        if (!c.dead) break
        c = undefined
      }
      if (!c) {
        c = new RawConn(host, port)
        all.add(c)
      }
      try {
        return await c.request(method, path, headers, body)
      } finally {
        if (c.dead) all.delete(c)
        else idle.push(c)
      }
    },
    close() {
      for (const c of all) c.close()
    },
  }
}

// ---------------------------------------------------------------------------------------------

function percentile(sorted, q) {
  if (!sorted.length) return null
  const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))
  return sorted[i]
}

function summary(ms) {
  const s = Float64Array.from(ms).sort()
  const mean = s.length ? s.reduce((a, b) => a + b, 0) / s.length : null
  return {
    count: s.length,
    p50_ms: percentile(s, 0.5),
    p90_ms: percentile(s, 0.9),
    p99_ms: percentile(s, 0.99),
    max_ms: s.length ? s[s.length - 1] : null,
    mean_ms: mean,
  }
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

// --token T: every request carries "Authorization: Bearer T" (a server with auth on)
let AUTH = {}

async function createStream(client, path) {
  const r = await client.request("PUT", path, { "Content-Type": CT, ...AUTH }, null)
  if (r.status < 200 || r.status >= 300) {
    throw new Error(`PUT ${path} -> ${r.status} ${r.body.toString().slice(0, 200)}`)
  }
  return r.headers["stream-next-offset"]
}

function emit(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n")
}

async function throughput(o) {
  const writers = Number(o.writers ?? 32)
  const size = Number(o.size ?? 100)
  const warmupMs = Number(o.warmup ?? 1) * 1000
  const durationMs = Number(o.duration ?? 10) * 1000
  const layout = o.layout ?? "per-writer"
  const prefix = o.prefix ?? `bench-${Date.now()}`
  const client = makeClient(o.client ?? "raw", o.url)
  const paths = []
  for (let i = 0; i < writers; i++) {
    paths.push(layout === "shared" ? `/v1/stream/${prefix}-shared` : `/v1/stream/${prefix}-w${i}`)
  }
  for (const p of new Set(paths)) await createStream(client, p)

  const body = Buffer.alloc(size, "x")
  const headers = { "Content-Type": CT, ...AUTH }
  const t0 = performance.now()
  const mStart = t0 + warmupMs
  const mEnd = mStart + durationMs
  let ok = 0
  let errors = 0
  let warmOk = 0
  const ack = []
  const errorSamples = []
  let realStart = 0
  let realEnd = 0
  const marks = [
    sleep(warmupMs).then(() => {
      realStart = performance.now()
      process.stdout.write("MARK start\n")
    }),
    sleep(warmupMs + durationMs).then(() => {
      realEnd = performance.now()
      process.stdout.write("MARK end\n")
    }),
  ]
  async function writer(i) {
    const path = paths[i]
    for (;;) {
      const s = performance.now()
      if (s >= mEnd) return
      let r
      try {
        r = await client.request("POST", path, headers, body)
      } catch (e) {
        errors++
        if (errorSamples.length < 5) errorSamples.push(String(e))
        await sleep(10)
        continue
      }
      const e = performance.now()
      if (r.status >= 200 && r.status < 300) {
        if (e >= mStart && e < mEnd) {
          ok++
          ack.push(e - s)
        } else if (e < mStart) warmOk++
      } else {
        errors++
        if (errorSamples.length < 5) errorSamples.push(`${r.status} ${r.body.toString().slice(0, 200)}`)
      }
    }
  }
  await Promise.all([...Array.from({ length: writers }, (_, i) => writer(i)), ...marks])
  client.close()
  const seconds = (realEnd - realStart) / 1000
  emit({
    mode: "throughput",
    layout,
    writers,
    size,
    streams: new Set(paths).size,
    seconds,
    appends: ok,
    warmup_appends: warmOk,
    errors,
    error_samples: errorSamples,
    appends_per_s: ok / seconds,
    ack: summary(ack),
  })
}

async function latency(o) {
  const rate = Number(o.rate ?? 200)
  const samples = Number(o.samples ?? 1000)
  const size = Number(o.size ?? 100)
  const warmupN = Math.round(Number(o.warmup ?? 1) * rate)
  const total = warmupN + samples
  const prefix = o.prefix ?? `bench-${Date.now()}`
  const path = `/v1/stream/${prefix}-lat`
  const wclient = makeClient(o.client ?? "raw", o.url)
  const rclient = makeClient(o.client ?? "raw", o.url)
  let offset = await createStream(wclient, path)
  const headers = { "Content-Type": CT, ...AUTH }

  const lat = []
  const ack = []
  const seen = new Uint8Array(total)
  let received = 0
  let polls = 0
  let emptyPolls = 0
  let errors = 0
  const errorSamples = []
  let stopReader = false
  let finishReader
  const readerDone = new Promise((r) => (finishReader = r))

  // Message layout (exactly `size` bytes): "<seq>:<send time in ms, performance.now()>:" then padding.
  function message(seq, ts) {
    const b = Buffer.alloc(size, ".")
    b.write(`${seq}:${ts.toFixed(4)}:`, 0, "latin1")
    return b
  }

  async function reader() {
    let cursor = null
    while (!stopReader) {
      let q = `${path}?offset=${encodeURIComponent(offset)}&live=long-poll`
      if (cursor) q += `&cursor=${encodeURIComponent(cursor)}`
      let r
      try {
        r = await rclient.request("GET", q, {}, null)
      } catch (e) {
        if (stopReader) break
        errors++
        if (errorSamples.length < 5) errorSamples.push(`reader: ${e}`)
        await sleep(10)
        continue
      }
      const now = performance.now()
      polls++
      if (r.status !== 200 && r.status !== 204) {
        errors++
        if (errorSamples.length < 5) errorSamples.push(`reader: ${r.status} ${r.body.toString().slice(0, 200)}`)
        await sleep(10)
        continue
      }
      if (r.headers["stream-next-offset"]) offset = r.headers["stream-next-offset"]
      if (r.headers["stream-cursor"]) cursor = r.headers["stream-cursor"]
      if (r.status === 204 || r.body.length === 0) {
        emptyPolls++
        continue
      }
      for (let at = 0; at + size <= r.body.length; at += size) {
        const head = r.body.toString("latin1", at, at + 40).split(":")
        const seq = Number(head[0])
        const ts = Number(head[1])
        if (!(seq >= 0 && seq < total) || seen[seq]) continue
        seen[seq] = 1
        received++
        if (seq >= warmupN) lat.push(now - ts)
      }
      if (received >= total) break
    }
    finishReader()
  }

  async function send(seq) {
    const ts = performance.now()
    try {
      const r = await wclient.request("POST", path, headers, message(seq, ts))
      if (r.status >= 200 && r.status < 300) {
        if (seq >= warmupN) ack.push(performance.now() - ts)
      } else {
        errors++
        if (errorSamples.length < 5) errorSamples.push(`writer: ${r.status} ${r.body.toString().slice(0, 200)}`)
      }
    } catch (e) {
      errors++
      if (errorSamples.length < 5) errorSamples.push(`writer: ${e}`)
    }
  }

  const readerTask = reader()
  await sleep(200) // let the first long-poll park before the first append
  const t0 = performance.now()
  const inflight = []
  let seq = 0
  let marked = false
  // Open loop: message i is sent at t0 + i / rate, whether or not earlier appends were acknowledged.
  while (seq < total) {
    const now = performance.now()
    while (seq < total && t0 + (seq * 1000) / rate <= now) {
      if (seq === warmupN && !marked) {
        marked = true
        process.stdout.write("MARK start\n")
      }
      inflight.push(send(seq++))
    }
    if (seq < total) await sleep(Math.max(0, t0 + (seq * 1000) / rate - performance.now()))
  }
  const sendSeconds = (performance.now() - t0) / 1000
  await Promise.all(inflight)
  const timeoutMs = Number(o["drain-timeout"] ?? 15) * 1000
  const timedOut = await Promise.race([readerDone.then(() => false), sleep(timeoutMs).then(() => true)])
  process.stdout.write("MARK end\n")
  stopReader = true
  wclient.close()
  rclient.close()
  void readerTask
  emit({
    mode: "latency",
    rate,
    size,
    sent: total,
    warmup_messages: warmupN,
    received,
    lost: total - received,
    timed_out: timedOut,
    send_seconds: sendSeconds,
    polls,
    empty_polls: emptyPolls,
    errors,
    error_samples: errorSamples,
    latency: summary(lat),
    ack: summary(ack),
  })
}

// A trivial HTTP/1.1 server on raw sockets: 204 to every request, keep-alive, body skipped.
function sink(o) {
  const port = Number(o.port)
  const reply = Buffer.from("HTTP/1.1 204 No Content\r\nStream-Next-Offset: 0\r\n\r\n", "latin1")
  const server = net.createServer((sock) => {
    sock.setNoDelay(true)
    let buf = Buffer.alloc(0)
    let skip = 0
    sock.on("data", (d) => {
      buf = buf.length ? Buffer.concat([buf, d]) : d
      let out = 0
      for (;;) {
        if (skip > 0) {
          const n = Math.min(skip, buf.length)
          skip -= n
          buf = buf.subarray(n)
          if (skip > 0) break
        }
        const idx = buf.indexOf("\r\n\r\n")
        if (idx < 0) break
        const head = buf.toString("latin1", 0, idx).toLowerCase()
        const m = /content-length:\s*(\d+)/.exec(head)
        skip = m ? Number(m[1]) : 0
        buf = buf.subarray(idx + 4)
        out++
      }
      if (out === 1) sock.write(reply)
      else if (out > 1) sock.write(Buffer.concat(Array(out).fill(reply)))
    })
    sock.on("error", () => {})
  })
  server.listen(port, "127.0.0.1", () => process.stdout.write(`listening ${port}\n`))
  for (const sig of ["SIGINT", "SIGTERM"]) process.on(sig, () => process.exit(0))
}

const opts = parseArgs(process.argv.slice(2))
if (opts.token) AUTH = { Authorization: `Bearer ${opts.token}` }
const cmd = opts._[0]
if (cmd === "throughput") await throughput(opts)
else if (cmd === "latency") await latency(opts)
else if (cmd === "sink") sink(opts)
else {
  process.stderr.write("usage: bench_load.mjs throughput|latency|sink [--options]\n")
  process.exit(2)
}
