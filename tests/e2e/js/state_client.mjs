// The official openai TypeScript/JavaScript SDK against two gateway replicas: chains (plain and streamed),
// retrieve, input items, delete, a conversation of three turns. Prints one JSON line of what it saw.
// Usage: node state_client.mjs URL_A URL_B MODEL KEY
import OpenAI from "openai";

const [urlA, urlB, model, apiKey] = process.argv.slice(2);
const replicas = [urlA, urlB].map((u) => new OpenAI({ baseURL: u + "/v1", apiKey, maxRetries: 0, timeout: 120000 }));
const out = { plain: [], streamed: [], conversation: [] };

let prev = null;
for (let turn = 0; turn < 3; turn++) {
  const c = replicas[turn % 2];
  const r = await c.responses.create({ model, input: `plain turn ${turn}`, max_output_tokens: 8,
                                       previous_response_id: prev });
  out.plain.push({ id: r.id, previous: r.previous_response_id, status: r.status, input: r.usage.input_tokens });
  prev = r.id;
}
const got = await replicas[1].responses.retrieve(prev);
out.retrieved = got.id === prev;
const items = [];
for await (const item of replicas[0].responses.inputItems.list(prev, { order: "asc" })) items.push(item);
out.input_user_texts = items.filter((i) => i.role === "user").map((i) => i.content[0].text);

prev = null;
for (let turn = 0; turn < 3; turn++) {
  const stream = await replicas[(turn + 1) % 2].responses.create({ model, input: `streamed turn ${turn}`,
                                                                 max_output_tokens: 8, previous_response_id: prev,
                                                                 stream: true });
  let done = null;
  let deltas = 0;
  for await (const ev of stream) {
    if (ev.type === "response.output_text.delta") deltas++;
    if (ev.type === "response.completed") done = ev.response;
  }
  out.streamed.push({ id: done.id, previous: done.previous_response_id, deltas, input: done.usage.input_tokens });
  prev = done.id;
}

await replicas[0].responses.delete(prev);
try {
  await replicas[1].responses.retrieve(prev);
  out.deleted = false;
} catch (e) {
  out.deleted = e.status === 404;
}

const conv = await replicas[0].conversations.create({ metadata: { from: "js" } });
for (let turn = 0; turn < 3; turn++) {
  const r = await replicas[turn % 2].responses.create({ model, input: `conversation turn ${turn}`,
                                                        max_output_tokens: 8, conversation: conv.id });
  out.conversation.push({ id: r.id, input: r.usage.input_tokens });
}
const convItems = [];
for await (const item of replicas[1].conversations.items.list(conv.id, { order: "asc" })) convItems.push(item);
out.conversation_roles = convItems.map((i) => i.role);
console.log(JSON.stringify(out));
