'use strict';
// Tests of the ShardLM Node.js client. The decoder tests run anywhere; the gateway tests need a
// running gateway with a model loaded, given by SHARDLM_ADDRESS (host:port), and are skipped
// without it. tests/clients/test_node_client.py starts one on a tiny test checkpoint and runs
// this file.

const test = require('node:test');
const assert = require('node:assert/strict');
const { ShardLMClient, ShardLMError, decodeStatus, status } = require('../src');
const { normalizeConstraint, normalizeGenerateRequest } = require('../src/client');

// ---------------------------------------------------------------- a tiny protobuf encoder
function varint(n) {
  let v = BigInt.asUintN(64, BigInt(n));
  const out = [];
  while (v >= 0x80n) {
    out.push(Number((v & 0x7fn) | 0x80n));
    v >>= 7n;
  }
  out.push(Number(v));
  return Buffer.from(out);
}
const tag = (field, wire) => varint((field << 3) | wire);
const lenField = (field, payload) => {
  const bytes = Buffer.isBuffer(payload) ? payload : Buffer.from(payload, 'utf8');
  return Buffer.concat([tag(field, 2), varint(bytes.length), bytes]);
};
const intField = (field, n) => Buffer.concat([tag(field, 0), varint(n)]);
const any = (typeName, value) => lenField(3, Buffer.concat([
  lenField(1, `type.googleapis.com/${typeName}`), lenField(2, value)]));

test('decodeStatus reads ErrorInfo, BadRequest, ResourceInfo and RetryInfo', () => {
  const errorInfo = Buffer.concat([
    lenField(1, 'INVALID_FIELD'), lenField(2, 'shardlm'),
    lenField(3, Buffer.concat([lenField(1, 'field'), lenField(2, 'sampling.temperature')])),
    lenField(3, Buffer.concat([lenField(1, 'extra'), lenField(2, 'ü')])),
  ]);
  const badRequest = Buffer.concat([
    lenField(1, Buffer.concat([lenField(1, 'sampling.temperature'), lenField(2, 'must be >= 0')])),
    lenField(1, Buffer.concat([lenField(1, 'sampling.top_p'), lenField(2, 'in (0, 1]')])),
  ]);
  const resource = Buffer.concat([lenField(1, 'shardlm.session'), lenField(2, 'abc')]);
  const retry = lenField(1, Buffer.concat([intField(1, 2), intField(2, 500000000)]));
  const unknown = Buffer.concat([intField(7, -1), lenField(9, 'future')]);
  const raw = Buffer.concat([
    intField(1, 3), lenField(2, 'invalid request'),
    any('google.rpc.ErrorInfo', errorInfo), any('google.rpc.BadRequest', badRequest),
    any('google.rpc.ResourceInfo', resource), any('google.rpc.RetryInfo', retry),
    any('example.Future', unknown), intField(15, 42), // unknown detail and unknown field
  ]);
  const s = decodeStatus(raw);
  assert.equal(s.code, 3);
  assert.equal(s.message, 'invalid request');
  assert.deepEqual(s.errorInfo, {
    reason: 'INVALID_FIELD', domain: 'shardlm',
    metadata: { field: 'sampling.temperature', extra: 'ü' },
  });
  assert.deepEqual(s.fieldViolations, [
    { field: 'sampling.temperature', description: 'must be >= 0' },
    { field: 'sampling.top_p', description: 'in (0, 1]' },
  ]);
  assert.deepEqual(s.resourceInfo,
    { resourceType: 'shardlm.session', resourceName: 'abc', owner: '', description: '' });
  assert.equal(s.retryDelayMs, 2500);
  assert.deepEqual(s.detailTypes, ['google.rpc.ErrorInfo', 'google.rpc.BadRequest',
    'google.rpc.ResourceInfo', 'google.rpc.RetryInfo', 'example.Future']);
});

test('decodeStatus rejects truncated input', () => {
  const raw = lenField(2, 'message');
  assert.throws(() => decodeStatus(raw.subarray(0, raw.length - 2)), /truncated/);
});

test('ShardLMError.fromGrpcError keeps the plain status without a details trailer', () => {
  const err = ShardLMError.fromGrpcError({ code: 14, details: 'connection refused', metadata: null });
  assert.ok(err instanceof ShardLMError);
  assert.equal(err.code, status.UNAVAILABLE);
  assert.equal(err.codeName, 'UNAVAILABLE');
  assert.equal(err.reason, null);
  assert.deepEqual(err.fieldViolations, []);
});

test('constraints: shorthands become the proto form, unknown kinds throw', () => {
  const schema = { type: 'object', properties: { ok: { type: 'boolean' } }, required: ['ok'] };
  assert.deepEqual(normalizeConstraint({ jsonSchema: schema }), { jsonSchema: JSON.stringify(schema) });
  assert.deepEqual(normalizeConstraint({ jsonSchema: '{"type":"string"}' }),
    { jsonSchema: '{"type":"string"}' }); // a string is sent as is
  assert.deepEqual(normalizeConstraint({ jsonSchema: true }), { jsonSchema: 'true' });
  assert.deepEqual(normalizeConstraint({ jsonObject: true }), { jsonObject: true });
  assert.deepEqual(normalizeConstraint({ regex: '[0-9]+' }), { regex: '[0-9]+' });
  assert.deepEqual(normalizeConstraint({ grammar: 'root ::= "a"' }), { grammar: 'root ::= "a"' });
  assert.deepEqual(normalizeConstraint({ choice: ['yes', 'no'] }), { choice: { choices: ['yes', 'no'] } });
  assert.deepEqual(normalizeConstraint({ choice: { choices: ['a'] } }), { choice: { choices: ['a'] } });
  const tag = { type: 'structural_tag', triggers: ['<f'], structures: [] };
  assert.deepEqual(normalizeConstraint({ structuralTag: tag }), { structuralTag: JSON.stringify(tag) });
  assert.deepEqual(normalizeConstraint({}), {});
  assert.throws(() => normalizeConstraint({ json_schema: schema }), /unknown constraint field.*json_schema/);
  assert.throws(() => normalizeConstraint({ regex: 'a', grammar: 'b' }), /one kind/);
  assert.throws(() => normalizeConstraint('{"regex": "a"}'), TypeError);
  const req = normalizeGenerateRequest({ prompt: 'hi', constraint: { choice: ['a', 'b'] } });
  assert.deepEqual(req, { text: 'hi', constraint: { choice: { choices: ['a', 'b'] } } });
  assert.equal('constraint' in normalizeGenerateRequest({ prompt: 'hi' }), false);
});

// ---------------------------------------------------------------- against a live gateway
// SHARDLM_AUTH_TOKEN: the gateway requires this bearer token (`shardlm serve --auth-tokens`).
const address = process.env.SHARDLM_ADDRESS;
const authToken = process.env.SHARDLM_AUTH_TOKEN || undefined;
const live = { skip: address ? false : 'SHARDLM_ADDRESS is not set (no gateway to test against)' };

test('gateway', live, async (t) => {
  const client = new ShardLMClient(address, { authToken });
  t.after(() => client.close());
  await client.waitForReady(20000);
  // Token ids as the prompt, so the test checkpoint's random tokenizer does not matter.
  const prompt = [1, 17, 42, 99, 5];

  await t.test('modelInfo describes the loaded model', async () => {
    const info = await client.modelInfo();
    assert.equal(info.loaded, true);
    assert.ok(info.model.vocabSize > 0);
    assert.ok(info.maxNewTokensLimit >= 16);
  });

  await t.test('tokenize gives each token its bytes', async () => {
    const text = 'h\u00e9llo, w\u00f6rld';
    const out = await client.tokenize(text, { addSpecialTokens: false });
    assert.equal(out.tokenBytes.length, out.tokenIds.length);
    assert.ok(out.tokenBytes.every((b) => Buffer.isBuffer(b)));
    assert.equal(Buffer.concat(out.tokenBytes).toString('utf8'), text);
  });

  await t.test('Generate streams 16 greedy tokens and a final chunk', async () => {
    const chunks = [];
    for await (const chunk of client.generate({
      tokenIds: prompt,
      sampling: { temperature: 0 },
      stop: { maxNewTokens: 16, ignoreEos: true },
    }, { timeoutMs: 30000 })) {
      chunks.push(chunk);
    }
    const tokenIds = chunks.flatMap((c) => c.tokenIds);
    assert.equal(tokenIds.length, 16);
    for (const id of tokenIds) assert.ok(Number.isInteger(id) && id >= 0);
    const last = chunks.at(-1);
    assert.equal(last.finishReason, 'FINISH_REASON_LENGTH');
    for (const c of chunks.slice(0, -1)) assert.equal(c.finishReason, 'FINISH_REASON_UNSPECIFIED');
    assert.equal(last.usage.promptTokens, prompt.length);
    assert.equal(last.usage.generatedTokens, 16);
    assert.ok(last.usage.cachedTokens <= prompt.length);
    assert.ok(last.timings.totalSeconds > 0);

    // Greedy decoding is deterministic: generateText returns the same tokens.
    const again = await client.generateText(prompt, { maxNewTokens: 16, ignoreEos: true });
    assert.deepEqual(again.tokenIds, tokenIds);
    assert.equal(again.finishReason, 'FINISH_REASON_LENGTH');
    assert.equal(again.usage.generatedTokens, 16);
    assert.equal(again.text, chunks.map((c) => c.text).join(''));
  });

  await t.test('a constraint restricts the text and ends with GRAMMAR_COMPLETE', async () => {
    const out = await client.generateText(prompt, { maxNewTokens: 32, constraint: { choice: ['yes', 'no'] } });
    assert.ok(['yes', 'no'].includes(out.text), out.text);
    assert.equal(out.finishReason, 'FINISH_REASON_GRAMMAR_COMPLETE');
    assert.equal(out.usage.constraintKind, 'choice');

    const schema = { type: 'object', properties: { word: { type: 'string', maxLength: 5 },
      ok: { type: 'boolean' } }, required: ['word', 'ok'], additionalProperties: false };
    const chunks = [];
    for await (const chunk of client.generate({ tokenIds: prompt, stop: { maxNewTokens: 64 },
      constraint: { jsonSchema: schema } })) {
      chunks.push(chunk);
    }
    const value = JSON.parse(chunks.map((c) => c.text).join(''));
    assert.deepEqual(Object.keys(value).sort(), ['ok', 'word']);
    assert.equal(typeof value.ok, 'boolean');
    assert.ok(typeof value.word === 'string' && value.word.length <= 5);
    assert.equal(chunks.at(-1).finishReason, 'FINISH_REASON_GRAMMAR_COMPLETE');
    assert.equal(chunks.at(-1).usage.constraintKind, 'json_schema');

    const plain = await client.generateText(prompt, { maxNewTokens: 2, ignoreEos: true });
    assert.equal(plain.usage.constraintKind, '');
    await assert.rejects(client.generateText(prompt, { constraint: { regex: 'a(b' } }),
      (err) => err instanceof ShardLMError && err.reason === 'INVALID_CONSTRAINT'
        && err.fieldViolations.some((v) => v.field === 'constraint.regex'));
  });

  await t.test('leaving the loop early cancels the stream', async () => {
    let seen = 0;
    for await (const chunk of client.generate({ prompt, stop: { maxNewTokens: 200, ignoreEos: true } })) {
      seen += chunk.tokenIds.length;
      break;
    }
    assert.ok(seen >= 1);
    const info = await client.modelInfo(); // the channel is still usable
    assert.equal(info.loaded, true);
  });

  await t.test('an invalid temperature fails with INVALID_FIELD and a field violation', async () => {
    const stream = client.generate({ tokenIds: prompt, sampling: { temperature: -1 },
      stop: { maxNewTokens: 4 } });
    await assert.rejects(async () => {
      for await (const chunk of stream) assert.fail(`unexpected chunk ${JSON.stringify(chunk)}`);
    }, (err) => {
      assert.ok(err instanceof ShardLMError, `not a ShardLMError: ${err}`);
      assert.equal(err.code, 3);
      assert.equal(err.codeName, 'INVALID_ARGUMENT');
      assert.equal(err.reason, 'INVALID_FIELD');
      assert.equal(err.domain, 'shardlm');
      assert.ok(err.details.length > 0);
      const violation = err.fieldViolations.find((v) => v.field === 'sampling.temperature');
      assert.ok(violation, `no violation for sampling.temperature: ${JSON.stringify(err.fieldViolations)}`);
      assert.ok(violation.description.length > 0);
      return true;
    });
    // The same error through generateText's promise.
    await assert.rejects(client.generateText(prompt, { temperature: -1, maxNewTokens: 4 }),
      { name: 'ShardLMError', code: 3, reason: 'INVALID_FIELD' });
  });

  await t.test('calls without the bearer token are refused', { skip: !authToken && 'auth is off' },
    async () => {
      for (const token of [undefined, `${authToken}-wrong`]) {
        const other = new ShardLMClient(address, { authToken: token });
        try {
          await assert.rejects(other.modelInfo(),
            { name: 'ShardLMError', code: 16, codeName: 'UNAUTHENTICATED', reason: 'UNAUTHENTICATED' });
          await assert.rejects(other.generateText(prompt, { maxNewTokens: 2 }),
            { code: status.UNAUTHENTICATED, reason: 'UNAUTHENTICATED' });
        } finally {
          other.close();
        }
      }
    });
});
