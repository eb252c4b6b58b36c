'use strict';
// A minimal protobuf wire-format reader for the rich error model: google.rpc.Status from the
// `grpc-status-details-bin` trailer and the detail messages ShardLM sends in it. The google.rpc
// protos are not part of this repository, so the few fields needed are decoded by number:
//
//   google.rpc.Status        { int32 code = 1; string message = 2; repeated Any details = 3; }
//   google.protobuf.Any      { string type_url = 1; bytes value = 2; }
//   google.rpc.ErrorInfo     { string reason = 1; string domain = 2; map<string,string> metadata = 3; }
//   google.rpc.BadRequest    { repeated FieldViolation field_violations = 1; }
//     FieldViolation         { string field = 1; string description = 2; }
//   google.rpc.ResourceInfo  { string resource_type = 1; string resource_name = 2;
//                              string owner = 3; string description = 4; }
//   google.rpc.RetryInfo     { google.protobuf.Duration retry_delay = 1; }
//   google.protobuf.Duration { int64 seconds = 1; int32 nanos = 2; }
//
// Unknown fields and unknown detail types are skipped, so newer servers stay readable.

const WIRE_VARINT = 0;
const WIRE_I64 = 1;
const WIRE_LEN = 2;
const WIRE_I32 = 5;

class WireError extends Error {}

/** Splits a message into [fieldNumber, wireType, value] triples (value: BigInt or Buffer). */
function* fields(buf) {
  let pos = 0;
  const varint = () => {
    let result = 0n;
    let shift = 0n;
    for (;;) {
      if (pos >= buf.length) throw new WireError('truncated varint');
      const byte = buf[pos++];
      result |= BigInt(byte & 0x7f) << shift;
      if ((byte & 0x80) === 0) return result;
      shift += 7n;
      if (shift > 63n) throw new WireError('varint too long');
    }
  };
  const take = (n) => {
    if (pos + n > buf.length) throw new WireError('truncated field');
    const out = buf.subarray(pos, pos + n);
    pos += n;
    return out;
  };
  while (pos < buf.length) {
    const key = varint();
    const number = Number(key >> 3n);
    const wire = Number(key & 7n);
    if (wire === WIRE_VARINT) yield [number, wire, varint()];
    else if (wire === WIRE_LEN) yield [number, wire, take(Number(varint()))];
    else if (wire === WIRE_I64) yield [number, wire, take(8)];
    else if (wire === WIRE_I32) yield [number, wire, take(4)];
    else throw new WireError(`unsupported wire type ${wire}`);
  }
}

const str = (v) => Buffer.from(v).toString('utf8');
// int32 fields are sign-extended to 64 bits on the wire.
const int32 = (v) => Number(BigInt.asIntN(32, v));

function decodeErrorInfo(buf) {
  const out = { reason: '', domain: '', metadata: {} };
  for (const [n, w, v] of fields(buf)) {
    if (w !== WIRE_LEN) continue;
    if (n === 1) out.reason = str(v);
    else if (n === 2) out.domain = str(v);
    else if (n === 3) {
      let key = '';
      let value = '';
      for (const [en, ew, ev] of fields(v)) {
        if (ew !== WIRE_LEN) continue;
        if (en === 1) key = str(ev);
        else if (en === 2) value = str(ev);
      }
      out.metadata[key] = value;
    }
  }
  return out;
}

function decodeBadRequest(buf) {
  const violations = [];
  for (const [n, w, v] of fields(buf)) {
    if (n !== 1 || w !== WIRE_LEN) continue;
    const violation = { field: '', description: '' };
    for (const [fn, fw, fv] of fields(v)) {
      if (fw !== WIRE_LEN) continue;
      if (fn === 1) violation.field = str(fv);
      else if (fn === 2) violation.description = str(fv);
    }
    violations.push(violation);
  }
  return violations;
}

function decodeResourceInfo(buf) {
  const out = { resourceType: '', resourceName: '', owner: '', description: '' };
  const names = { 1: 'resourceType', 2: 'resourceName', 3: 'owner', 4: 'description' };
  for (const [n, w, v] of fields(buf)) {
    if (w === WIRE_LEN && names[n]) out[names[n]] = str(v);
  }
  return out;
}

/** RetryInfo -> the retry delay in milliseconds (or null when absent). */
function decodeRetryInfo(buf) {
  for (const [n, w, v] of fields(buf)) {
    if (n !== 1 || w !== WIRE_LEN) continue;
    let seconds = 0n;
    let nanos = 0;
    for (const [dn, dw, dv] of fields(v)) {
      if (dw !== WIRE_VARINT) continue;
      if (dn === 1) seconds = BigInt.asIntN(64, dv);
      else if (dn === 2) nanos = int32(dv);
    }
    return Number(seconds) * 1000 + nanos / 1e6;
  }
  return null;
}

const DETAIL_TYPES = {
  'google.rpc.ErrorInfo': 'errorInfo',
  'google.rpc.BadRequest': 'badRequest',
  'google.rpc.ResourceInfo': 'resourceInfo',
  'google.rpc.RetryInfo': 'retryInfo',
};

/**
 * Decodes a serialized google.rpc.Status.
 * @param {Buffer|Uint8Array} buf
 * @returns {{code:number, message:string, errorInfo:object|null, fieldViolations:object[],
 *            resourceInfo:object|null, retryDelayMs:number|null, detailTypes:string[]}}
 */
function decodeStatus(buf) {
  const status = {
    code: 0, message: '', errorInfo: null, fieldViolations: [], resourceInfo: null,
    retryDelayMs: null, detailTypes: [],
  };
  for (const [n, w, v] of fields(Buffer.from(buf))) {
    if (n === 1 && w === WIRE_VARINT) status.code = int32(v);
    else if (n === 2 && w === WIRE_LEN) status.message = str(v);
    else if (n === 3 && w === WIRE_LEN) {
      let typeUrl = '';
      let value = Buffer.alloc(0);
      for (const [an, aw, av] of fields(v)) {
        if (aw !== WIRE_LEN) continue;
        if (an === 1) typeUrl = str(av);
        else if (an === 2) value = av;
      }
      const typeName = typeUrl.slice(typeUrl.lastIndexOf('/') + 1);
      status.detailTypes.push(typeName);
      switch (DETAIL_TYPES[typeName]) {
        case 'errorInfo': status.errorInfo = decodeErrorInfo(value); break;
        case 'badRequest': status.fieldViolations.push(...decodeBadRequest(value)); break;
        case 'resourceInfo': status.resourceInfo = decodeResourceInfo(value); break;
        case 'retryInfo': status.retryDelayMs = decodeRetryInfo(value); break;
        default: break; // an unknown detail type: skipped
      }
    }
  }
  return status;
}

module.exports = { decodeStatus, WireError };
