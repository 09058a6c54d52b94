// OpenAI's JavaScript SDK against the gateway (tests/gateway/test_openai_sdk.py runs it):
// one chat and one streamed chat; prints what it got as one JSON line.
const OpenAI = require("openai");

async function main() {
  const client = new OpenAI({ baseURL: process.env.BASE_URL, apiKey: process.env.API_KEY, maxRetries: 0 });
  const messages = [{ role: "user", content: "one two three" }];
  const done = await client.chat.completions.create({ model: "demo", messages });
  const stream = await client.chat.completions.create({ model: "demo", messages, stream: true });
  let streamed = "";
  let chunks = 0;
  let usage = 0;
  for await (const chunk of stream) {
    // Without optional chaining: a usage-only chunk the client did not ask for would throw here.
    streamed += chunk.choices[0].delta.content || "";
    chunks += 1;
    if (chunk.usage) usage += 1;
  }
  console.log(JSON.stringify({ content: done.choices[0].message.content, usage: done.usage, streamed, chunks, usage_chunks: usage }));
}

main().catch((e) => {
  console.error(String(e));
  process.exit(1);
});
