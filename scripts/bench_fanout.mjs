// Live fan-out load for scripts/bench_fanout.py: N subscribers (long-poll or SSE) on one JSON
// stream, one writer appending {"i": n, "t": ms} at a steady rate. Prints one JSON line of results.
//
//   node bench_fanout.mjs '{"base": "http://127.0.0.1:4437", "path": "/v1/stream/fanout-1",
//                          "mode": "long-poll"|"sse"|"mixed", "subscribers": 1000, "rate": 20,
//                          "seconds": 10, "addresses": 20, "settle": 3, "streams": 1}'
//
// With "streams": S > 1 (a chat-like load: many streams, a few followers each), the streams are
// PATH-0 .. PATH-(S-1), subscriber k follows stream k % S and message i goes to stream i % S:
// each subscriber must see every message of its stream, in order.
//
// The writer first appends `warmup` seconds of messages at the same rate (default 2): every
// subscriber must get those too, in order, but their delays are reported apart
// (warmup_delivery_ms_p99), since the first second is slow against any server (the load
// generator's own code is still being compiled: against the reference the first three
// messages took 170-340 ms, then 40-120).
//
// Subscribers connect from `addresses` loopback source addresses (127.0.0.11, ...), as many
// clients would: a per-client live cap counts each address on its own. Each subscriber checks
// that it sees message i+1 right after i (nothing lost, repeated or reordered) and records the
// delay from the moment the writer sent the append to the moment the subscriber parsed it.
import http from "node:http"
import { performance } from "node:perf_hooks"

const cfg = JSON.parse(process.argv[2])
const base = new URL(cfg.base)
const now = () => performance.now()

function request(agent, localAddress, method, path, body, headers = {}) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: base.hostname, port: base.port, method, path, agent, localAddress,
      headers: body ? { ...headers, "Content-Length": Buffer.byteLength(body) } : headers }, (res) => {
      const chunks = []
      res.on("data", (c) => chunks.push(c))
      res.on("end", () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(chunks) }))
      res.on("error", reject)
    })
    req.on("error", reject)
    if (body) req.write(body)
    req.end()
  })
}

const stats = { errors: 0, errorSamples: [], outOfOrder: 0, requests: 0, connected: 0 }
const latencies = []
const warmLatencies = []
const warm = Math.round(cfg.rate * (cfg.warmup ?? 2))
const subs = []

const S = cfg.streams ?? 1
const pathOf = (s) => (S === 1 ? cfg.path : `${cfg.path}-${s}`)
// how many of messages lo .. hi-1 go to stream s
const countOf = (s, lo, hi) => Math.max(0, Math.ceil((hi - s) / S) - Math.ceil((lo - s) / S))

function note(sub, messages, at) {
  for (const m of messages) {
    if (m.i !== sub.next) {
      stats.outOfOrder++
      sub.next = m.i + S
      continue
    }
    sub.next += S
    sub.got++
    if (m.i >= warm) latencies.push(at - m.t)
    else if (m.i >= 0) warmLatencies.push(at - m.t)
  }
}

function fail(e) {
  stats.errors++
  if (stats.errorSamples.length < 5) stats.errorSamples.push(String(e).slice(0, 200))
}

async function longPoller(sub, agent, addr, offset) {
  let cursor = null
  let first = true
  while (!stopping) {
    const q = `?offset=${encodeURIComponent(offset)}&live=long-poll${cursor ? "&cursor=" + cursor : ""}`
    let r
    try {
      stats.requests++
      if (first) { stats.connected++; first = false }
      r = await request(agent, addr, "GET", sub.path + q)
    } catch (e) {
      fail(e)
      await new Promise((ok) => setTimeout(ok, 100))
      continue
    }
    const at = now()
    if (r.status === 200) note(sub, JSON.parse(r.body.toString("utf8")), at)
    else if (r.status !== 204) { fail(`HTTP ${r.status} ${r.body.toString().slice(0, 100)}`); await new Promise((ok) => setTimeout(ok, 100)) }
    if (r.headers["stream-next-offset"]) offset = r.headers["stream-next-offset"]
    if (r.headers["stream-cursor"]) cursor = r.headers["stream-cursor"]
  }
}

function sseSubscriber(sub, agent, addr, offset) {
  return new Promise((resolve) => {
    const open = (from) => {
      if (stopping) return resolve()
      stats.requests++
      const req = http.request({ host: base.hostname, port: base.port, agent, localAddress: addr,
        path: `${sub.path}?offset=${encodeURIComponent(from)}&live=sse` }, (res) => {
        if (res.statusCode !== 200) { fail(`SSE HTTP ${res.statusCode}`); res.resume(); return setTimeout(() => open(from), 100) }
        stats.connected++
        let buf = ""
        let event = ""
        let data = []
        res.setEncoding("utf8")
        res.on("data", (text) => {
          const at = now()
          buf += text
          let nl
          while ((nl = buf.indexOf("\n")) >= 0) {
            const line = buf.slice(0, nl).replace(/\r$/, "")
            buf = buf.slice(nl + 1)
            if (line.startsWith("event:")) event = line.slice(6).trim()
            else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""))
            else if (line === "") {
              if (event === "data") note(sub, JSON.parse(data.join("\n")), at)
              else if (event === "control") from = JSON.parse(data.join("\n")).streamNextOffset
              event = ""
              data = []
            }
          }
        })
        res.on("end", () => setTimeout(() => open(from), 0))  // the server ends SSE responses now and then
        res.on("error", () => {})
      })
      req.on("error", (e) => { if (!stopping) { fail(e); setTimeout(() => open(from), 100) } else resolve() })
      req.end()
      sub.req = req
    }
    open(offset)
  })
}

let stopping = false
const addresses = Array.from({ length: cfg.addresses ?? 20 }, (_, k) => `127.0.0.${11 + k}`)
const writerAgent = new http.Agent({ keepAlive: true, maxSockets: 1 })

const tails = []
for (let s = 0; s < S; s++) {
  const created = await request(writerAgent, undefined, "PUT", pathOf(s), null, { "Content-Type": "application/json" })
  if (created.status !== 201 && created.status !== 200) throw new Error(`PUT ${pathOf(s)}: ${created.status}`)
  const seed = await request(writerAgent, undefined, "POST", pathOf(s), JSON.stringify({ i: -1, t: 0 }),
    { "Content-Type": "application/json" })
  tails.push(seed.headers["stream-next-offset"])
}

const agents = addresses.map(() => new http.Agent({ keepAlive: true, maxSockets: Infinity }))
const tasks = []
for (let k = 0; k < cfg.subscribers; k++) {
  const stream = k % S
  const sub = { next: stream, got: 0, stream, path: pathOf(stream) }
  subs.push(sub)
  const a = k % addresses.length
  const mode = cfg.mode === "mixed" ? (k % 2 ? "sse" : "long-poll") : cfg.mode
  sub.mode = mode
  const tail = tails[stream]
  tasks.push(mode === "sse" ? sseSubscriber(sub, agents[a], addresses[a], tail) : longPoller(sub, agents[a], addresses[a], tail))
}
const settleUntil = now() + (cfg.settle ?? 3) * 1000
while (stats.connected < cfg.subscribers && now() < settleUntil + 30000) await new Promise((ok) => setTimeout(ok, 50))
while (now() < settleUntil) await new Promise((ok) => setTimeout(ok, 50))
const connectedAtStart = stats.connected

// The writer: message i is due at start + i / rate; it waits for each answer (one connection).
// Messages 0 .. warm-1 are the warm-up; the measured ones follow without a pause.
const total = Math.round(cfg.rate * cfg.seconds)
const all = warm + total
const t0 = now()
const writeLatencies = []
let written = 0
let cpuBefore = process.cpuUsage()
let measuredFrom = t0
for (let i = 0; i < all; i++) {
  const due = t0 + (i * 1000) / cfg.rate
  const wait = due - now()
  if (wait > 0) await new Promise((ok) => setTimeout(ok, wait))
  if (i === warm) { measuredFrom = now(); cpuBefore = process.cpuUsage() }
  const t = now()
  const r = await request(writerAgent, undefined, "POST", pathOf(i % S), JSON.stringify({ i, t }), { "Content-Type": "application/json" })
  if (r.status !== 200 && r.status !== 204) { fail(`append HTTP ${r.status}`); continue }
  if (i >= warm) {
    writeLatencies.push(now() - t)
    written++
  }
}
const writeSeconds = (now() - measuredFrom) / 1000
// Wait for every subscriber to see every message (or give up after 15 s).
const deadline = now() + 15000
while (now() < deadline && subs.some((s) => s.got < countOf(s.stream, 0, all))) await new Promise((ok) => setTimeout(ok, 20))
const cpu = process.cpuUsage(cpuBefore)
stopping = true
for (const s of subs) s.req?.destroy()
for (const a of agents) a.destroy()
writerAgent.destroy()

const pct = (xs, p) => {
  if (!xs.length) return null
  const s = Float64Array.from(xs).sort()
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]
}
const complete = subs.filter((s) => s.got === countOf(s.stream, 0, all) && s.next >= all).length
const expected = subs.reduce((n, s) => n + countOf(s.stream, warm, all), 0)
console.log(JSON.stringify({
  mode: cfg.mode, subscribers: cfg.subscribers, connected_at_start: connectedAtStart,
  messages: total, written, writer_rate: written / writeSeconds, target_rate: cfg.rate,
  append_ms_p50: pct(writeLatencies, 50), append_ms_p99: pct(writeLatencies, 99),
  complete_subscribers: complete, deliveries: latencies.length, expected_deliveries: expected, streams: S,
  out_of_order: stats.outOfOrder, errors: stats.errors, error_samples: stats.errorSamples,
  requests: stats.requests, delivery_ms_p50: pct(latencies, 50), delivery_ms_p99: pct(latencies, 99),
  delivery_ms_max: pct(latencies, 100), loadgen_cpu_s: (cpu.user + cpu.system) / 1e6,
  warmup_messages: warm, warmup_delivery_ms_p50: pct(warmLatencies, 50),
  warmup_delivery_ms_p99: pct(warmLatencies, 99),
}))
process.exit(0)
