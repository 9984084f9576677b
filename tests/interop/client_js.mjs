// Interop driver for the official TypeScript client (@durable-streams/client) against a server.
// Usage: node client_js.mjs BASE_URL TAG
// Runs each scenario against its own stream under BASE_URL/v1/stream/interop-js-TAG-<scenario> and
// prints one line `RESULT <json>`: {scenario: {...observed values...} | {error: "..."}}.
// tests/test_interop.py compares the observed values with what was written; this script asserts
// nothing itself, so every scenario reports even when an earlier one fails.
import { DurableStream, IdempotentProducer, stream } from "@durable-streams/client"

const base = (process.argv[2] ?? "http://127.0.0.1:4437").replace(/\/$/, "")
const tag = process.argv[3] ?? String(Date.now())
const streamUrl = (name) => `${base}/v1/stream/interop-js-${tag}-${name}`
const sleep = (ms) => new Promise((s) => setTimeout(s, ms))
const withTimeout = (p, ms, what) =>
  Promise.race([p, new Promise((_, rej) => setTimeout(() => rej(new Error(`timeout: ${what}`)), ms))])
const hex = (u8) => Buffer.from(u8).toString("hex")

// A fetch that records, for every request, its live mode and the answer's status and content type,
// so the test can tell that an SSE read really was served as text/event-stream.
function recordingFetch(log) {
  return async (input, init) => {
    const res = await fetch(input, init)
    const u = new URL(typeof input === "string" || input instanceof URL ? input : input.url)
    log.push({ live: u.searchParams.get("live"), status: res.status, contentType: res.headers.get("content-type") })
    return res
  }
}

// Start a live read (long-poll or SSE) at the current tail, append after it is running, and collect
// what it delivers until `done(collected)` holds. kind: "json" | "text" | "bytes".
// Returns {data, requests}: what was received and the requests the read made.
async function liveRead(handle, mode, kind, append, done) {
  const { offset } = await handle.head()
  const requests = []
  const res = await stream({
    url: handle.url, offset, live: mode, json: kind === "json" ? true : undefined, fetch: recordingFetch(requests),
  })
  let acc = kind === "json" ? [] : kind === "text" ? "" : []
  const got = new Promise((resolve) => {
    const finish = () => { unsub(); res.cancel(); resolve(acc) }
    const unsub =
      kind === "json" ? res.subscribeJson(async (b) => { acc = acc.concat(b.items); if (done(acc)) finish() })
      : kind === "text" ? res.subscribeText(async (c) => { acc += c.text; if (done(acc)) finish() })
      : res.subscribeBytes(async (c) => { acc = acc.concat(Array.from(c.data)); if (done(acc)) finish() })
  })
  await sleep(300)
  await append()
  const out = await withTimeout(got, 10000, `${kind} ${mode} read`)
  return { data: kind === "bytes" ? hex(Uint8Array.from(out)) : out, requests }
}

const scenarios = {
  // JSON mode: create, 3 appends, catch-up, long-poll and SSE live reads, idempotent producer,
  // resume from a saved offset, close, delete.
  async json() {
    const r = {}
    const handle = await DurableStream.create({ url: streamUrl("json"), contentType: "application/json" })
    for (let i = 1; i <= 3; i++) await handle.append(JSON.stringify({ n: i, msg: `hello ${i}` }))
    const cu = await handle.stream({ live: false })
    r.catchup = await cu.json()
    const saved = cu.offset
    r.longpoll = await liveRead(handle, "long-poll", "json",
      () => handle.append(JSON.stringify({ n: 4, msg: "live via long-poll" })), (a) => a.length >= 1)
    r.sse = await liveRead(handle, "sse", "json",
      () => handle.append(JSON.stringify({ n: 5, msg: "live via sse" })), (a) => a.length >= 1)
    const producer = new IdempotentProducer(handle, `interop-js-${tag}`, {
      autoClaim: true, onError: (e) => { r.producerError = String(e) },
    })
    producer.append(JSON.stringify({ n: 6, msg: "via producer" }))
    producer.append(JSON.stringify({ n: 7, msg: "via producer" }))
    await producer.flush()
    await producer.close()
    r.all = await (await handle.stream({ live: false })).json()
    r.resumed = await (await stream({ url: handle.url, offset: saved, live: false, json: true })).json()
    const closed = await handle.close()
    const head = await handle.head()
    r.head = { contentType: head.contentType, offset: head.offset, streamClosed: head.streamClosed }
    r.closeOffset = closed.finalOffset
    const eof = await handle.stream({ live: false })
    await eof.json()
    r.readClosed = eof.streamClosed
    await handle.delete()
    r.existsAfterDelete = (await DurableStream.head({ url: handle.url })).exists
    return r
  },
  // text/plain: byte-exact UTF-8 text through catch-up, long-poll and SSE.
  async text() {
    const r = {}
    const handle = await DurableStream.create({ url: streamUrl("text"), contentType: "text/plain" })
    await handle.append("héllo ")
    await handle.append("wörld ✓\n")
    r.catchup = await (await handle.stream({ live: false })).text()
    r.longpoll = await liveRead(handle, "long-poll", "text", () => handle.append("long-poll ✓\n"),
      (t) => t.length >= "long-poll ✓\n".length)
    r.sse = await liveRead(handle, "sse", "text", () => handle.append("sse ✓\n"),
      (t) => t.length >= "sse ✓\n".length)
    r.all = await (await handle.stream({ live: false })).text()
    r.contentType = (await handle.head()).contentType
    await handle.delete()
    return r
  },
  // application/octet-stream: every byte value through catch-up, long-poll and SSE (base64 events).
  async bytes() {
    const r = {}
    const handle = await DurableStream.create({ url: streamUrl("bytes"), contentType: "application/octet-stream" })
    const up = Uint8Array.from({ length: 256 }, (_, i) => i)
    const down = Uint8Array.from({ length: 256 }, (_, i) => 255 - i)
    await handle.append(up)
    r.catchup = hex(await (await handle.stream({ live: false })).body())
    r.longpoll = await liveRead(handle, "long-poll", "bytes", () => handle.append(down), (a) => a.length >= 256)
    r.sse = await liveRead(handle, "sse", "bytes", () => handle.append(up.slice(0, 100)), (a) => a.length >= 100)
    r.all = hex(await (await handle.stream({ live: false })).body())
    await handle.delete()
    return r
  },
}

const only = process.argv.slice(4)
const results = {}
for (const [name, fn] of Object.entries(scenarios)) {
  if (only.length && !only.includes(name)) continue
  try {
    results[name] = await withTimeout(fn(), 30000, `scenario ${name}`)
  } catch (e) {
    results[name] = { error: `${e?.name ?? "Error"}: ${e?.message ?? e}${e?.status ? ` (HTTP ${e.status})` : ""}` }
  }
}
console.log(`RESULT ${JSON.stringify(results)}`)
process.exit(0)
