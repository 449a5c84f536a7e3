#!lua name=pliant_tpcc

-- A TPC-C-like transaction mix as Redis Functions (VoltDB's stored procedures): every key of a
-- warehouse carries its partition's hash tag, so one transaction runs on one master, atomically,
-- and reaches the replicas as its effects. KEYS[1] is the warehouse key '{tag}:w<n>'; every
-- other key is derived from it. Amounts are integer cents.
--
-- Writing transactions take a transaction id first (ARGV[1]) and record it in '<w>:txns': a
-- client that retries after an error it cannot interpret (a master that moved, a lost reply)
-- sends the same id, and a transaction already applied is not applied again (it returns
-- 'DUP'). What a payment pays is a function of its id, so the warehouse's year-to-date total
-- can be checked against the ids recorded.
--
-- Scaled down from TPC-C: districts, customers and items per warehouse are arguments of
-- tpcc_load; no history table, no item names, no customer lookup by name.

local function price(i)
  return (i % 100) + 1
end

-- The payment amount of a transaction id: 1.00 to 50.00.
local function amount_of(txn)
  local h = 0
  for k = 1, #txn do
    h = (h * 31 + string.byte(txn, k)) % 1000003
  end
  return 100 + h % 4901
end

local function first_time(w, txn)
  return redis.call('SADD', w .. ':txns', txn) == 1
end

-- Creates the warehouse; one that exists is left as it is ('EXISTS'): its totals and orders
-- belong together.
local function tpcc_load(keys, args)
  local w = keys[1]
  if redis.call('EXISTS', w) == 1 then
    return 'EXISTS'
  end
  local dn, cn, items = tonumber(args[1]), tonumber(args[2]), tonumber(args[3])
  redis.call('HSET', w, 'ytd', 3000000 * dn, 'districts', dn, 'customers', cn, 'items', items,
    'ytd0', 3000000 * dn)
  for d = 1, dn do
    redis.call('HSET', w .. ':d' .. d, 'ytd', 3000000, 'next_o_id', 1)
    for c = 1, cn do
      redis.call('HSET', w .. ':c' .. d .. ':' .. c, 'balance', -1000, 'ytd_payment', 1000,
        'payment_cnt', 1, 'delivery_cnt', 0, 'delivered', 0)
    end
  end
  for i = 1, items do
    redis.call('HSET', w .. ':s' .. i, 'quantity', 50 + i % 41, 'ytd', 0, 'order_cnt', 0)
  end
  return 'OK'
end

-- ARGV: txn, district, customer, lines, then item and quantity per line. An item 0 is an
-- invalid item: the order is refused before anything is written (TPC-C's 1 % rollbacks).
local function new_order(keys, args)
  local w = keys[1]
  local d, c, n = args[2], args[3], tonumber(args[4])
  for k = 1, n do
    if tonumber(args[3 + 2 * k]) == 0 then
      return redis.error_reply('ROLLBACK item not found')
    end
  end
  if not first_time(w, args[1]) then
    return 'DUP'
  end
  local o = redis.call('HINCRBY', w .. ':d' .. d, 'next_o_id', 1) - 1
  local total, lines = 0, {}
  for k = 1, n do
    local i, q = tonumber(args[3 + 2 * k]), tonumber(args[4 + 2 * k])
    local s = w .. ':s' .. i
    local sq = tonumber(redis.call('HGET', s, 'quantity'))
    if sq - q >= 10 then sq = sq - q else sq = sq - q + 91 end
    redis.call('HSET', s, 'quantity', sq)
    redis.call('HINCRBY', s, 'ytd', q)
    redis.call('HINCRBY', s, 'order_cnt', 1)
    local amount = q * price(i)
    total = total + amount
    lines[#lines + 1] = i .. ':' .. q .. ':' .. amount
  end
  local ok = w .. ':o' .. d .. ':' .. o
  redis.call('HSET', ok, 'c_id', c, 'ol_cnt', n, 'carrier', 0, 'total', total)
  redis.call('RPUSH', ok .. ':ol', unpack(lines))
  redis.call('RPUSH', w .. ':no' .. d, o)
  redis.call('HSET', w .. ':c' .. d .. ':' .. c, 'last_o', o)
  return o
end

-- ARGV: txn, district, customer.
local function payment(keys, args)
  local w = keys[1]
  if not first_time(w, args[1]) then
    return 'DUP'
  end
  local amount = amount_of(args[1])
  local ck = w .. ':c' .. args[2] .. ':' .. args[3]
  redis.call('HINCRBY', w, 'ytd', amount)
  redis.call('HINCRBY', w .. ':d' .. args[2], 'ytd', amount)
  redis.call('HINCRBY', ck, 'balance', -amount)
  redis.call('HINCRBY', ck, 'ytd_payment', amount)
  redis.call('HINCRBY', ck, 'payment_cnt', 1)
  return amount
end

-- ARGV: txn, carrier. Delivers the oldest undelivered order of every district.
local function delivery(keys, args)
  local w = keys[1]
  if not first_time(w, args[1]) then
    return 'DUP'
  end
  local dn = tonumber(redis.call('HGET', w, 'districts'))
  local delivered = 0
  for d = 1, dn do
    local o = redis.call('LPOP', w .. ':no' .. d)
    if o then
      local ok = w .. ':o' .. d .. ':' .. o
      redis.call('HSET', ok, 'carrier', args[2])
      local total = tonumber(redis.call('HGET', ok, 'total'))
      local ck = w .. ':c' .. d .. ':' .. redis.call('HGET', ok, 'c_id')
      redis.call('HINCRBY', ck, 'balance', total)
      redis.call('HINCRBY', ck, 'delivered', total)
      redis.call('HINCRBY', ck, 'delivery_cnt', 1)
      delivered = delivered + 1
    end
  end
  return delivered
end

-- ARGV: district, customer. The customer's balance, last order and its carrier.
local function order_status(keys, args)
  local w = keys[1]
  local ck = w .. ':c' .. args[1] .. ':' .. args[2]
  local c = redis.call('HMGET', ck, 'balance', 'last_o')
  local carrier = false
  if c[2] then
    carrier = redis.call('HGET', w .. ':o' .. args[1] .. ':' .. c[2], 'carrier')
  end
  return { c[1], c[2] or 0, carrier or 0 }
end

-- ARGV: district, threshold. Distinct items of the district's last 20 orders whose stock is
-- below the threshold.
local function stock_level(keys, args)
  local w = keys[1]
  local d, threshold = args[1], tonumber(args[2])
  local next_o = tonumber(redis.call('HGET', w .. ':d' .. d, 'next_o_id'))
  local seen, low = {}, 0
  for o = math.max(1, next_o - 20), next_o - 1 do
    for _, line in ipairs(redis.call('LRANGE', w .. ':o' .. d .. ':' .. o .. ':ol', 0, -1)) do
      local i = string.match(line, '^(%d+):')
      if not seen[i] then
        seen[i] = true
        if tonumber(redis.call('HGET', w .. ':s' .. i, 'quantity')) < threshold then
          low = low + 1
        end
      end
    end
  end
  return low
end

-- The warehouse's consistency conditions (TPC-C 3.3.2, those this schema has), as a list of
-- violations (empty: consistent), then the recorded payments' total.
local function check(keys, args)
  local w = keys[1]
  local bad = {}
  local wh = redis.call('HMGET', w, 'ytd', 'districts', 'customers', 'ytd0')
  local ytd, dn, cn, ytd0 = tonumber(wh[1]), tonumber(wh[2]), tonumber(wh[3]), tonumber(wh[4])
  local paid = 0
  for _, txn in ipairs(redis.call('SMEMBERS', w .. ':txns')) do
    if string.sub(txn, 1, 2) == 'p:' then
      paid = paid + amount_of(txn)
    end
  end
  if ytd ~= ytd0 + paid then
    bad[#bad + 1] = 'W_YTD ' .. ytd .. ' != initial ' .. ytd0 .. ' + recorded payments ' .. paid
  end
  local dsum = 0
  for d = 1, dn do
    local dk = w .. ':d' .. d
    local dh = redis.call('HMGET', dk, 'ytd', 'next_o_id')
    dsum = dsum + tonumber(dh[1])
    local next_o = tonumber(dh[2])
    -- 2: orders 1 .. next_o_id - 1 exist, and no other; 4: their lines are all there.
    for o = 1, next_o - 1 do
      local ol = redis.call('HGET', w .. ':o' .. d .. ':' .. o, 'ol_cnt')
      if not ol then
        bad[#bad + 1] = 'district ' .. d .. ': order ' .. o .. ' missing (next ' .. next_o .. ')'
      elseif tonumber(ol) ~= redis.call('LLEN', w .. ':o' .. d .. ':' .. o .. ':ol') then
        bad[#bad + 1] = 'district ' .. d .. ': order ' .. o .. ' lines differ from its count'
      end
    end
    if redis.call('EXISTS', w .. ':o' .. d .. ':' .. next_o) == 1 then
      bad[#bad + 1] = 'district ' .. d .. ': order ' .. next_o .. ' beyond next_o_id'
    end
    -- 3: the undelivered orders are the newest ones, contiguous.
    local no = redis.call('LRANGE', w .. ':no' .. d, 0, -1)
    for k = 1, #no do
      if tonumber(no[k]) ~= next_o - #no + k - 1 then
        bad[#bad + 1] = 'district ' .. d .. ': undelivered orders not the newest, contiguous'
        break
      end
    end
    -- 5: a customer's balance is what was delivered to it minus what it paid.
    for c = 1, cn do
      local ch = redis.call('HMGET', w .. ':c' .. d .. ':' .. c, 'balance', 'ytd_payment',
        'delivered')
      if tonumber(ch[1]) ~= tonumber(ch[3]) - tonumber(ch[2]) then
        bad[#bad + 1] = 'customer ' .. d .. ':' .. c .. ': balance != delivered - paid'
      end
    end
  end
  -- 1: the warehouse's year-to-date is its districts'.
  if ytd ~= dsum then
    bad[#bad + 1] = 'W_YTD ' .. ytd .. ' != sum of D_YTD ' .. dsum
  end
  return { bad, paid }
end

redis.register_function('tpcc_load', tpcc_load)
redis.register_function('new_order', new_order)
redis.register_function('payment', payment)
redis.register_function('delivery', delivery)
redis.register_function{ function_name = 'order_status', callback = order_status,
  flags = { 'no-writes' } }
redis.register_function{ function_name = 'stock_level', callback = stock_level,
  flags = { 'no-writes' } }
redis.register_function{ function_name = 'tpcc_check', callback = check, flags = { 'no-writes' } }
