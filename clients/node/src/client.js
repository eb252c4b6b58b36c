'use strict';
// ShardLM gateway client for Node.js.
//
// Messages are plain objects with camelCase field names (proto-loader keepCase: false), enums
// are their value names ("FINISH_REASON_LENGTH"), 64-bit integers are decimal strings (so no
// precision is lost), unset scalar fields carry their default value and unset message fields
// are null. The .proto files are loaded at run time from the repository's proto/ folder (or
// from `protoRoot`).

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { decodeStatus } = require('./status');

const DEFAULT_PROTO_ROOT = path.resolve(__dirname, '..', '..', '..', 'proto');
const GATEWAY_PROTO = 'shardlm/gateway/v1/gateway.proto';
const DETAILS_KEY = 'grpc-status-details-bin';

const LOADER_OPTIONS = {
  keepCase: false,
  enums: String,
  longs: String,
  defaults: true,
  oneofs: true,
};

const STATUS_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

const packages = new Map(); // protoRoot -> loaded package, shared by clients

function loadGatewayService(protoRoot) {
  if (!packages.has(protoRoot)) {
    const definition = protoLoader.loadSync(path.join(protoRoot, GATEWAY_PROTO), {
      ...LOADER_OPTIONS,
      includeDirs: [protoRoot],
    });
    packages.set(protoRoot, grpc.loadPackageDefinition(definition));
  }
  return packages.get(protoRoot).shardlm.gateway.v1.GatewayService;
}

/**
 * An error of a ShardLM call, with the details of the server's google.rpc.Status.
 *
 * code: the gRPC status number (3); codeName: its name ("INVALID_ARGUMENT"); details: the
 * server's message; reason: the stable ErrorInfo reason ("INVALID_FIELD"), or null when the
 * status carried no ErrorInfo (for example a connection failure detected by the client);
 * domain and metadata: the rest of ErrorInfo; fieldViolations: [{field, description}] from
 * BadRequest; resourceInfo: {resourceType, resourceName, owner, description} or null;
 * retryDelayMs: RetryInfo's suggested wait, or null.
 */
class ShardLMError extends Error {
  constructor({ code, details = '', reason = null, domain = '', metadata = {},
    fieldViolations = [], resourceInfo = null, retryDelayMs = null, cause } = {}) {
    const codeName = STATUS_NAMES[code] || `STATUS_${code}`;
    super(`${codeName}${reason ? ` ${reason}` : ''}: ${details}`, cause ? { cause } : undefined);
    this.name = 'ShardLMError';
    this.code = code;
    this.codeName = codeName;
    this.details = details;
    this.reason = reason;
    this.domain = domain;
    this.metadata = metadata;
    this.fieldViolations = fieldViolations;
    this.resourceInfo = resourceInfo;
    this.retryDelayMs = retryDelayMs;
  }

  /** Converts an error of @grpc/grpc-js (a ServiceError) into a ShardLMError. */
  static fromGrpcError(err) {
    if (err instanceof ShardLMError || typeof err?.code !== 'number') return err;
    const fields = { code: err.code, details: err.details ?? err.message, cause: err };
    const raw = err.metadata?.get?.(DETAILS_KEY)?.[0];
    if (raw) {
      try {
        const status = decodeStatus(raw);
        Object.assign(fields, {
          details: status.message || fields.details,
          reason: status.errorInfo?.reason || null,
          domain: status.errorInfo?.domain || '',
          metadata: status.errorInfo?.metadata || {},
          fieldViolations: status.fieldViolations,
          resourceInfo: status.resourceInfo,
          retryDelayMs: status.retryDelayMs,
        });
      } catch {
        // A malformed trailer: keep the plain status.
      }
    }
    return new ShardLMError(fields);
  }
}

const isMessageList = (a) => Array.isArray(a) && a.every((m) => m && typeof m === 'object');
const isTokenList = (a) => Array.isArray(a) && a.every((t) => Number.isInteger(t));

const CONSTRAINT_KINDS = ['jsonSchema', 'jsonObject', 'regex', 'grammar', 'choice', 'structuralTag'];
const toJson = (v) => (typeof v === 'string' ? v : JSON.stringify(v));

/**
 * Normalizes a Constraint (shardlm.common.v1.Constraint, camelCase like every message): at most
 * one of jsonSchema, jsonObject, regex, grammar, choice, structuralTag. Shorthands: jsonSchema
 * and structuralTag may be objects (JSON.stringify'd; a string is sent as is, and jsonSchema may
 * be true or false), choice an array of strings. `{}` is an empty Constraint (no kind: no
 * constraint). Unknown keys (such as snake_case `json_schema`) throw rather than being dropped
 * silently, which would leave the generation unconstrained.
 */
function normalizeConstraint(constraint) {
  if (constraint === null || typeof constraint !== 'object' || Array.isArray(constraint)) {
    throw new TypeError('constraint must be an object such as { jsonSchema: {...} }');
  }
  const keys = Object.keys(constraint).filter((k) => constraint[k] !== undefined
    && constraint[k] !== null);
  const unknown = keys.filter((k) => !CONSTRAINT_KINDS.includes(k));
  if (unknown.length) {
    throw new TypeError(`unknown constraint field(s) ${unknown.join(', ')}; `
      + `use one of ${CONSTRAINT_KINDS.join(', ')} (camelCase)`);
  }
  if (keys.length > 1) throw new TypeError(`a constraint has one kind, not ${keys.join(' and ')}`);
  const out = {};
  for (const k of keys) {
    const v = constraint[k];
    if (k === 'jsonSchema') out.jsonSchema = toJson(v);
    else if (k === 'structuralTag') out.structuralTag = toJson(v);
    else if (k === 'choice') out.choice = Array.isArray(v) ? { choices: v } : v;
    else out[k] = v;
  }
  return out;
}

/**
 * Normalizes the shorthands of a GenerateRequest: `prompt` (a string, an array of token ids or
 * an array of {role, content}), `tokenIds: [..]` and `messages: [..]` become the proto's oneof
 * members, and `constraint` is normalized by normalizeConstraint. A request already in proto
 * form is passed through.
 */
function normalizeGenerateRequest(request) {
  const req = { ...request };
  if (req.constraint !== undefined && req.constraint !== null) {
    req.constraint = normalizeConstraint(req.constraint);
  }
  if ('prompt' in req) {
    const { prompt } = req;
    delete req.prompt;
    if (typeof prompt === 'string') req.text = prompt;
    else if (isTokenList(prompt)) req.tokenIds = prompt;
    else if (isMessageList(prompt)) req.messages = prompt;
    else throw new TypeError('prompt must be a string, an array of token ids or of messages');
  }
  if (Array.isArray(req.tokenIds)) req.tokenIds = { tokenIds: req.tokenIds };
  if (Array.isArray(req.messages)) req.messages = { messages: req.messages };
  return req;
}

/** The GenerateRequest for generateText's prompt and options. */
function textRequest(prompt, opts) {
  const sampling = { ...(opts.sampling || {}) };
  for (const key of ['temperature', 'topK', 'topP', 'minP', 'seed', 'repetitionPenalty',
    'presencePenalty', 'frequencyPenalty', 'logprobs', 'topLogprobs']) {
    if (opts[key] !== undefined) sampling[key] = opts[key];
  }
  const stop = { ...(opts.stopConditions || {}) };
  if (opts.maxNewTokens !== undefined) stop.maxNewTokens = opts.maxNewTokens;
  if (opts.stop !== undefined) stop.stopSequences = [].concat(opts.stop);
  if (opts.stopTokenIds !== undefined) stop.stopTokenIds = opts.stopTokenIds;
  if (opts.ignoreEos !== undefined) stop.ignoreEos = opts.ignoreEos;
  const request = { prompt, sampling, stop };
  if (opts.addSpecialTokens !== undefined) request.addSpecialTokens = opts.addSpecialTokens;
  if (opts.constraint !== undefined && opts.constraint !== null) request.constraint = opts.constraint;
  return request;
}

class ShardLMClient {
  /**
   * @param {string} address host:port of the gateway
   * @param {object} [options]
   * @param {boolean} [options.insecure=true] plaintext; false uses TLS
   * @param {Buffer} [options.rootCerts] PEM root certificates for TLS (default: system roots)
   * @param {string} [options.authToken] sent as `authorization: Bearer <token>` on every call
   * @param {string} [options.protoRoot] folder holding shardlm/... protos (default: the repo's)
   * @param {object} [options.channelOptions] extra grpc-js channel options
   */
  constructor(address, { insecure = true, rootCerts, authToken, protoRoot = DEFAULT_PROTO_ROOT,
    channelOptions = {} } = {}) {
    const Service = loadGatewayService(protoRoot);
    const credentials = insecure
      ? grpc.credentials.createInsecure()
      : grpc.credentials.createSsl(rootCerts ?? null);
    this.address = address;
    this._authToken = authToken;
    this._stub = new Service(address, credentials, channelOptions);
  }

  _metadata(extra) {
    const md = new grpc.Metadata();
    if (this._authToken) md.set('authorization', `Bearer ${this._authToken}`);
    for (const [k, v] of Object.entries(extra || {})) md.set(k, v);
    return md;
  }

  _callOptions({ timeoutMs, deadline } = {}) {
    if (deadline !== undefined) return { deadline };
    if (timeoutMs !== undefined) return { deadline: new Date(Date.now() + timeoutMs) };
    return {};
  }

  _unary(method, request, options = {}) {
    return new Promise((resolve, reject) => {
      const call = this._stub[method](request, this._metadata(options.metadata),
        this._callOptions(options), (err, reply) => {
          if (err) reject(ShardLMError.fromGrpcError(err));
          else resolve(reply);
        });
      if (options.signal) {
        if (options.signal.aborted) call.cancel();
        else options.signal.addEventListener('abort', () => call.cancel(), { once: true });
      }
    });
  }

  /**
   * Streams a generation. `request` is a GenerateRequest (camelCase, see normalizeGenerateRequest
   * for the prompt shorthands). Returns an async iterator of GenerateResponse chunks:
   * {tokenIds, text, logprobs, finishReason, usage, timings}; the final chunk has a finishReason
   * other than "FINISH_REASON_UNSPECIFIED" and carries usage and timings. The call starts when
   * iteration starts; leaving the loop early cancels it. Errors are thrown as ShardLMError.
   * `request.constraint` (see normalizeConstraint) constrains the text, e.g.
   * `{ jsonSchema: {...} }`; the generation then ends with "FINISH_REASON_GRAMMAR_COMPLETE"
   * and `usage.constraintKind` names the kind ("json_schema").
   *
   * @param {object} request
   * @param {{timeoutMs?: number, deadline?: Date, signal?: AbortSignal, metadata?: object}} [options]
   */
  async* generate(request, options = {}) {
    const call = this._stub.Generate(normalizeGenerateRequest(request),
      this._metadata(options.metadata), this._callOptions(options));
    call.on('error', () => {}); // errors surface through the iterator below
    const { signal } = options;
    const onAbort = () => call.cancel();
    if (signal?.aborted) call.cancel();
    signal?.addEventListener('abort', onAbort, { once: true });
    let finished = false;
    try {
      for await (const chunk of call) yield chunk;
      finished = true;
    } catch (err) {
      finished = true;
      throw ShardLMError.fromGrpcError(err);
    } finally {
      signal?.removeEventListener('abort', onAbort);
      if (!finished) call.cancel();
    }
  }

  /**
   * Generates a completion and resolves with the whole of it.
   *
   * @param {string|number[]|{role:string,content:string}[]} prompt text, token ids or chat messages
   * @param {object} [opts] maxNewTokens, temperature, topK, topP, minP, seed, repetitionPenalty,
   *   presencePenalty, frequencyPenalty, logprobs, topLogprobs, stop (string or strings),
   *   stopTokenIds, ignoreEos, addSpecialTokens, sampling / stopConditions (whole messages),
   *   constraint ({ jsonSchema }, { regex }, { choice: [...] }, ...; see normalizeConstraint),
   *   and the call options timeoutMs, deadline, signal, metadata.
   * @returns {Promise<{text:string, tokenIds:number[], finishReason:string, usage:object,
   *   timings:object, logprobs:object[]}>}
   */
  async generateText(prompt, opts = {}) {
    const result = { text: '', tokenIds: [], finishReason: 'FINISH_REASON_UNSPECIFIED',
      usage: null, timings: null, logprobs: [] };
    for await (const chunk of this.generate(textRequest(prompt, opts), opts)) {
      result.text += chunk.text;
      result.tokenIds.push(...chunk.tokenIds);
      result.logprobs.push(...chunk.logprobs);
      if (chunk.finishReason !== 'FINISH_REASON_UNSPECIFIED') result.finishReason = chunk.finishReason;
      if (chunk.usage) result.usage = chunk.usage;
      if (chunk.timings) result.timings = chunk.timings;
    }
    return result;
  }

  /** GetModelInfo: {loaded, model, capacity, serverVersion, maxNewTokensLimit, maxContextLength}. */
  modelInfo(options = {}) {
    return this._unary('GetModelInfo', {}, options);
  }

  /**
   * Tokenize: `input` is a string or an array of {role, content}; resolves with
   * {tokenIds, tokens, tokenBytes}: per token its vocabulary string and the bytes (a Buffer) it
   * stands for in decoded text.
   */
  tokenize(input, { addSpecialTokens, ...options } = {}) {
    const request = typeof input === 'string' ? { text: input } : { messages: { messages: input } };
    if (addSpecialTokens !== undefined) request.addSpecialTokens = addSpecialTokens;
    return this._unary('Tokenize', request, options);
  }

  /** Resolves once the channel is connected; rejects after timeoutMs. */
  waitForReady(timeoutMs = 10000) {
    return new Promise((resolve, reject) => {
      this._stub.waitForReady(new Date(Date.now() + timeoutMs), (err) => (err ? reject(err) : resolve()));
    });
  }

  /** Closes the channel; calls in flight are cancelled. */
  close() {
    this._stub.close();
  }
}

module.exports = {
  ShardLMClient, ShardLMError, normalizeConstraint, normalizeGenerateRequest, status: grpc.status,
};
